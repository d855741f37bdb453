"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

Each sub-layer (attention, MoE) reads one collapsed stream (`pre` weights), and writes back
`post * f + comb^T @ streams`, where `comb` is made doubly stochastic by Sinkhorn iterations.
All mixing weights are computed in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .linear import dense


def _mixes(x: jnp.ndarray, fn: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x `[B, S, hc, D]` -> fn @ rms_normalised(flatten(x)) `[B, S, fn_rows]` in fp32 (fn: an array or,
    in the layer stack on CPU, a LayerWeight)."""
    flat = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
    return dense(flat, fn.astype(jnp.float32))


def _mix(w: jnp.ndarray, x: jnp.ndarray) -> jnp.ndarray:
    """sum_j w[..., j, None] * x[..., j, :]: w `[B, S, hc, ...]` fp32, x `[B, S, hc, D]` fp32 ->
    `[B, S, ..., D]`. Written as hc elementwise terms, one fusion on every platform: a contraction
    of length hc gives a matrix unit nothing to do, and as an einsum XLA makes it a batch of one
    tiny matmul per token."""
    terms = [w[:, :, j, ..., None] * jnp.expand_dims(x[:, :, j], tuple(range(2, w.ndim - 1)))
             for j in range(x.shape[2])]
    return sum(terms[1:], terms[0])


def sinkhorn(logits: jnp.ndarray, iters: int, eps: float) -> jnp.ndarray:
    """`[..., hc, hc]` logits -> row softmax + eps, a column normalisation, then `iters - 1`
    (row, column) rounds: ends on a column normalisation."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, c)


def hc_pre(x: jnp.ndarray, fn: jnp.ndarray, base: jnp.ndarray, scale: jnp.ndarray, *, hc: int,
           iters: int, hc_eps: float, norm_eps: float):
    """Collapses the streams for a sub-layer.

    x `[B, S, hc, D]`; fn `[(2+hc)*hc, hc*D]`, base `[(2+hc)*hc]`, scale `[3]`.
    Returns (collapsed `[B, S, D]` in x's dtype, post `[B, S, hc]` fp32, comb `[B, S, hc, hc]` fp32).
    """
    m = _mixes(x, fn, norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = m[..., 2 * hc:] * scale[2] + base[2 * hc:]
    comb = sinkhorn(comb_logits.reshape(*m.shape[:-1], hc, hc), iters, hc_eps)
    collapsed = _mix(pre, x.astype(jnp.float32)).astype(x.dtype)
    return collapsed, post, comb


def hc_post(f: jnp.ndarray, x_res: jnp.ndarray, post: jnp.ndarray, comb: jnp.ndarray) -> jnp.ndarray:
    """Expands a sub-layer output back into the streams: X'_k = post_k f + sum_j comb[j, k] X_j.

    f `[B, S, D]`, x_res `[B, S, hc, D]`; computed in fp32, returned in x_res's dtype.
    """
    mixed = _mix(comb, x_res.astype(jnp.float32))
    return (post[..., None] * f.astype(jnp.float32)[..., None, :] + mixed).astype(x_res.dtype)


def hc_head(x: jnp.ndarray, fn: jnp.ndarray, base: jnp.ndarray, scale: jnp.ndarray, *, hc_eps: float,
            norm_eps: float) -> jnp.ndarray:
    """Final collapse of the streams (no Sinkhorn, no post): x `[B, S, hc, D]` -> `[B, S, D]`."""
    m = _mixes(x, fn, norm_eps)
    pre = jax.nn.sigmoid(m * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + hc_eps
    return _mix(pre, x.astype(jnp.float32)).astype(x.dtype)
