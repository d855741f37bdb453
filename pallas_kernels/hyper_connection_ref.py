"""Plain-JAX reference of the hyper-connections' two passes over the streams, in fp32.

`hc_collapse_ref`: the mixes m = fn @ rms_normalised(flatten(x)) and the streams collapsed by the
pre weights sigmoid(m[:hc] * scale[0] + base[:hc]) + hc_eps; `hc_expand_ref`: a sub-layer's
output written back into the streams, X'_k = post_k f + sum_j comb[j, k] X_j.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def mix(w: jnp.ndarray, x: jnp.ndarray) -> jnp.ndarray:
    """sum_j w[..., j, None] * x[..., j, :]: w `[B, S, hc, ...]` fp32, x `[B, S, hc, D]` fp32 ->
    `[B, S, ..., D]`. Written as hc elementwise terms, one fusion on every platform: a contraction
    of length hc gives a matrix unit nothing to do, and as an einsum XLA makes it a batch of one
    tiny matmul per token."""
    terms = [w[:, :, j, ..., None] * jnp.expand_dims(x[:, :, j], tuple(range(2, w.ndim - 1)))
             for j in range(x.shape[2])]
    return sum(terms[1:], terms[0])


def _product(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)


def hc_collapse_ref(x: jnp.ndarray, fn, base: jnp.ndarray, scale: jnp.ndarray, *, hc_eps: float,
                    norm_eps: float, product: Callable = _product):
    """x `[B, S, hc, D]`; fn `[R, hc * D]` (R >= hc rows of mixes), base `[R]`, scale `[>= 1]` ->
    (collapsed `[B, S, D]` in x's dtype, the mixes fp32 `[B, S, R]`). product(x, w): x `[..., in]`
    times w `[out, in]` (the model's CPU form passes `linear.dense`, whose weight may be a per-layer
    buffer)."""
    hc = x.shape[-2]
    flat = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    m = product(flat, fn.astype(jnp.float32))
    return mix(pre_weights(m, base, scale, hc, hc_eps), x.astype(jnp.float32)).astype(x.dtype), m


def pre_weights(m: jnp.ndarray, base: jnp.ndarray, scale: jnp.ndarray, hc: int, hc_eps: float) -> jnp.ndarray:
    """The collapse's weights of the streams from the mixes m fp32 `[..., R]`:
    sigmoid(m[:hc] * scale[0] + base[:hc]) + hc_eps, fp32 `[..., hc]`."""
    return jax.nn.sigmoid(m[..., :hc] * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)[:hc]) + hc_eps


def hc_expand_ref(f: jnp.ndarray, x: jnp.ndarray, post: jnp.ndarray, comb: jnp.ndarray) -> jnp.ndarray:
    """f `[B, S, D]`, x `[B, S, hc, D]`, post fp32 `[B, S, hc]`, comb fp32 `[B, S, hc, hc]` ->
    post_k f + sum_j comb[j, k] x_j `[B, S, hc, D]` in x's dtype (computed in fp32)."""
    mixed = mix(comb, x.astype(jnp.float32))
    return (post[..., None] * f.astype(jnp.float32)[..., None, :] + mixed).astype(x.dtype)
