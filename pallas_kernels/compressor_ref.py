"""Plain-JAX reference of the KV compressor: gated pooling of token blocks into one entry each.

For ratio 4 (overlap) entry j pools 8 candidates per channel c: the previous block's tokens
with their first-half features [0, d), then this block's tokens with their second-half
features [d, 2d). For ratio 128 (no overlap) entry j pools its own 128 tokens. The pooling is a
softmax over candidates, independently per channel, in fp32. The entry is then RMS-normalised
and its last rope dims rotated (interleaved) at position j * ratio.
"""

from __future__ import annotations

import jax.numpy as jnp

from .numerics import apply_rope, rms_norm


def _fold(x: jnp.ndarray, op) -> jnp.ndarray:
    """x `[B, n, r, d]` reduced over axis 2 with the associative op, halving r at each step."""
    while x.shape[2] > 1:
        h = x.shape[2] // 2
        x = jnp.concatenate([op(x[:, :, :h], x[:, :, h:2 * h]), x[:, :, 2 * h:]], axis=2)
    return x[:, :, 0]


def compress_ref(a: jnp.ndarray, z: jnp.ndarray, norm_weight: jnp.ndarray, cos: jnp.ndarray,
                 sin: jnp.ndarray, *, ratio: int, eps: float, prev_a: jnp.ndarray | None = None,
                 prev_z: jnp.ndarray | None = None, out_dtype=jnp.float32) -> jnp.ndarray:
    """Pools n complete blocks into n entries.

    a, z: fp32 `[B, n * ratio, C]` values and gate logits (`ape` already added), C = 2d with
      overlap (ratio 4), d without (ratio 128).
    norm_weight: `[d]`. cos, sin: `[B, n, rope/2]` at positions j * ratio.
    prev_a, prev_z: `[B, ratio, C]`, the block before the first one (overlap only); None means
      there is none (its candidates get weight 0).
    Returns `[B, n, d]` in out_dtype (the pooled value is rounded to out_dtype before the norm).
    """
    b, length, c = a.shape
    n = length // ratio
    overlap = ratio == 4
    d = c // 2 if overlap else c
    if n == 0:
        return jnp.zeros((b, 0, d), out_dtype)
    a = a.astype(jnp.float32).reshape(b, n, ratio, c)
    z = z.astype(jnp.float32).reshape(b, n, ratio, c)
    if overlap:
        if prev_a is None:
            prev_a = jnp.zeros((b, 1, ratio, d), jnp.float32)
            prev_z = jnp.full((b, 1, ratio, d), -jnp.inf, jnp.float32)
        else:
            prev_a = prev_a.astype(jnp.float32)[:, None, :, :d]
            prev_z = prev_z.astype(jnp.float32)[:, None, :, :d]
        # Candidates of entry j: block j-1's first halves, then block j's second halves.
        before_a = jnp.concatenate([prev_a, a[:, :-1, :, :d]], axis=1)
        before_z = jnp.concatenate([prev_z, z[:, :-1, :, :d]], axis=1)
        a = jnp.concatenate([before_a, a[..., d:]], axis=2)
        z = jnp.concatenate([before_z, z[..., d:]], axis=2)
    # softmax over the candidates (axis 2), then the weighted sum: as pairwise folds of the
    # candidate axis, elementwise ops XLA:CPU fuses into one pass; its reductions over a short
    # middle axis ran several times slower (docs/speed.md).
    m = _fold(z, jnp.maximum)
    e = jnp.exp(z - m[:, :, None])
    pooled = _fold(a * e, jnp.add) / _fold(e, jnp.add)  # [B, n, d]
    entry = rms_norm(pooled.astype(out_dtype), norm_weight, eps)
    return apply_rope(entry, cos, sin)
