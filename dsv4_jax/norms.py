"""RMS normalisations."""

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
