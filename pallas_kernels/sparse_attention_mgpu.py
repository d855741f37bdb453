"""Sparse-gather attention: the Mosaic GPU path (placeholder, see README.md "GPU status")."""

from __future__ import annotations

from .sparse_attention_ref import sparse_attention_ref

HAVE_KERNEL = False


def sparse_attention_mgpu(q, kv, indices, sink, *, scale: float):
    """No Mosaic GPU kernel yet: lowers to the plain-JAX reference (XLA gather + dots)."""
    return sparse_attention_ref(q, kv, indices, sink, scale=scale)
