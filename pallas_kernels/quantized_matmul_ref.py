"""x times a quantized weight, in plain JAX: the weight dequantized whole, then multiplied."""

from __future__ import annotations

import jax.numpy as jnp


def quantized_matmul_ref(x, w):
    """x `[M, K]` (bf16 or fp32) times w (a 2-d `QuantizedWeight` `[N, K]`, dsv4_jax/model/quantized.py)
    transposed: `[M, N]` in x's dtype. The weight is dequantized to x's dtype (value times scale
    in fp32, rounded once), the products accumulate in fp32."""
    y = jnp.einsum("mk,nk->mn", x, w.dequantize(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
