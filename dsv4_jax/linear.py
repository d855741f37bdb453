"""Dense projections with the reference's dtype rule: the input is cast to the weight's dtype,
products accumulate in fp32, and the output comes back in the weight's dtype.

A `QuantizedWeight` (FP8 / FP4, `dsv4-convert --dtype native`) is dequantized here, inside the
jitted computation, to its compute dtype (exactly: see dsv4_jax/quantized.py), then multiplied
the same way, so a native checkpoint gives the same results as a dequantized one."""

from __future__ import annotations

import jax.numpy as jnp

from .layer_weights import with_weight
from .quantized import QuantizedWeight


def weight_array(w) -> jnp.ndarray:
    """w itself, or a QuantizedWeight dequantized to its compute dtype."""
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def dense(x: jnp.ndarray, w) -> jnp.ndarray:
    """x `[..., in]`, w `[out, in]` (array, QuantizedWeight or LayerWeight) -> `[..., out]` in
    w's dtype."""
    return with_weight(_dense, w, x)


def _dense(w, x: jnp.ndarray) -> jnp.ndarray:
    wd = weight_array(w)
    y = jnp.einsum("...i,oi->...o", x.astype(wd.dtype), wd, preferred_element_type=jnp.float32)
    return y.astype(wd.dtype)
