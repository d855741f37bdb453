"""KV compressor: the Mosaic GPU path (placeholder, see README.md "GPU status")."""

from __future__ import annotations

from .compressor_ref import compress_ref

HAVE_KERNEL = False


def compress_mgpu(a, z, norm_weight, cos, sin, *, ratio, eps, prev_a=None, prev_z=None, out_dtype=None):
    """No Mosaic GPU kernel yet: lowers to the plain-JAX reference (XLA fusions)."""
    return compress_ref(a, z, norm_weight, cos, sin, ratio=ratio, eps=eps, prev_a=prev_a, prev_z=prev_z,
                        out_dtype=out_dtype)
