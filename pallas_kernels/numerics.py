"""The numerics the kernels' references share with the model: the weighted and unweighted RMS
normalisations and the interleaved rotary embedding (its frequencies: dsv4_jax/model/rope.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """Weighted RMSNorm over the last axis: fp32 inside, the weight multiplied in fp32 before
    rounding back to x's dtype (as the reference does)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def unweighted_rms_norm(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x * rsqrt(mean(x^2) + eps) over the last axis; the statistic in fp32, the product in x's dtype."""
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x * r.astype(x.dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, inverse: bool = False) -> jnp.ndarray:
    """Rotates the last `2 * cos.shape[-1]` dims of `x` as complex pairs (x[2i], x[2i+1]).

    x `[..., D]`; cos/sin broadcastable to `[..., rope/2]`. Computed in fp32, returned in x's
    dtype; the leading (nope) dims pass through untouched. `inverse` multiplies by the conjugate.
    """
    half = cos.shape[-1]
    start = x.shape[-1] - 2 * half
    rope = x[..., start:]
    pairs = rope.astype(jnp.float32).reshape(*rope.shape[:-1], half, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    out_re = re * cos - im * sin
    out_im = im * cos + re * sin
    rotated = jnp.stack([out_re, out_im], axis=-1).reshape(rope.shape).astype(x.dtype)
    # Concatenated, not written over x's last dims with dynamic_update_slice: XLA:CPU (jaxlib
    # 0.10.2) fuses that write in place into x's buffer with the rotation inside the same loop,
    # so a pair's second element reads its first one already rotated (seen as wrong queries in
    # the decode step of a layer stack of one kind, e.g. the MTP block's).
    return jnp.concatenate([x[..., :start], rotated], axis=-1)


def rotate_row_heads(x: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray], head_dim: int,
                     inverse: bool = False) -> jnp.ndarray:
    """`apply_rope` on every head of rows x `[M, H * head_dim]` (a row's heads side by side) at
    its row's angle: rope = (cos, sin), each `[M, rope/2]`."""
    cos, sin = rope
    m = x.shape[0]
    return apply_rope(x.reshape(m, -1, head_dim), cos[:, None], sin[:, None], inverse=inverse).reshape(m, -1)


def rotate_heads(x: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray], inverse: bool = False) -> jnp.ndarray:
    """`apply_rope` on every head of x `[B, T, H, D]` at its token's position: rope = (cos, sin),
    each `[B, T, rope/2]`."""
    cos, sin = rope
    return apply_rope(x, cos[..., None, :], sin[..., None, :], inverse=inverse)
