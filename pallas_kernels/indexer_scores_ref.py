"""The lightning indexer's scores in plain JAX: the reference the kernels are checked against, and
what runs on CPU and, over keys as values, on TPU (XLA there computes the product with the ReLU,
the weights and the head sum as its epilogue and writes only the scores)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def indexer_scores_ref(q: jnp.ndarray, keys: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    """q `[B, T, H, D]`, keys `[B, N, D]`, weights `[B, T, H]` (already / sqrt(H)) -> scores fp32
    `[B, T, N]`: sum_h weights[b, t, h] * ReLU(q[b, t, h] . keys[b, n]) / sqrt(D), in fp32."""
    # keys as the left operand, its rows contracted along their last (contiguous) axis: with the
    # keys on the right XLA:CPU first copied the whole key pool transposed, on every decode step
    s = jnp.einsum("bnd,bthd->bnth", keys.astype(jnp.float32), q.astype(jnp.float32))
    s = jax.nn.relu(s) * (q.shape[-1] ** -0.5)
    return jnp.einsum("bnth,bth->btn", s, weights.astype(jnp.float32))
