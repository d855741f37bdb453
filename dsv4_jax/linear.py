"""Dense projections with the reference's dtype rule: the input is cast to the weight's dtype,
products accumulate in fp32, and the output comes back in the weight's dtype.

A `QuantizedWeight` (FP8 / FP4, `dsv4-convert --dtype native`) is dequantized here, inside the
jitted computation, to its compute dtype (exactly: see dsv4_jax/quantized.py), then multiplied
the same way, so a native checkpoint gives the same results as a dequantized one: a weight whose
scale blocks divide it goes by its blocks on TPU and GPU (`QuantizedWeight.matmul`: the
compilers fuse the dequantization into the product instead of writing the weight out; the same
products, summed in another order), as a whole elsewhere."""

from __future__ import annotations

import math

import jax
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
    if isinstance(w, QuantizedWeight) and w.blocked():
        # TPU / GPU: by blocks (QuantizedWeight.matmul). The CPU keeps the whole dequantized
        # weight: its products sum in the order a dequantized checkpoint's do, bit for bit.
        return jax.lax.platform_dependent(w, x, cpu=_dense_whole,
                                          default=lambda w, x: w.matmul(x.astype(w.dtype)).astype(w.dtype))
    return _dense_whole(w, x)


def _dense_whole(w, x: jnp.ndarray) -> jnp.ndarray:
    wd = weight_array(w)
    x = x.astype(wd.dtype)
    if _in_halves(x, wd):
        n, k = wd.shape
        xs = jnp.broadcast_to(x, (2,) + x.shape)
        y = jnp.einsum("p...i,poi->...po", xs, wd.reshape(2, n // 2, k),
                       preferred_element_type=jnp.float32).reshape(*x.shape[:-1], n)
    else:
        y = jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32)
    return y.astype(wd.dtype)


# A weight of at least this many elements, multiplied by few enough rows that the product stays under
# HALVES_MAX_PRODUCT multiply-adds, goes as a batch of two half-weight products on CPU (`_in_halves`).
HALVES_MIN_ELEMENTS = 1 << 17
HALVES_MAX_PRODUCT = 1 << 20


def _in_halves(x: jnp.ndarray, w: jnp.ndarray) -> bool:
    """Whether to multiply by w as two halves of its rows in one batched product: XLA:CPU runs a
    product of a few rows by a 1-4 MB (fp32) weight on one thread, and the batched form on both
    (decode's projections: about 1.6x). Larger products are threaded already; TPU and GPU need
    none of this."""
    rows = math.prod(x.shape[:-1])
    return (jax.default_backend() == "cpu" and w.ndim == 2 and w.shape[0] % 2 == 0
            and w.size >= HALVES_MIN_ELEMENTS and rows * w.size < HALVES_MAX_PRODUCT)
