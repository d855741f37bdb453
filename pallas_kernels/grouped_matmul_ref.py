"""Rows grouped by expert times their experts' weights, in plain JAX: the experts dequantized
whole, then one ragged product; and the routed experts' first half, two such products and
their SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_ref(x, w, group_sizes, *, layer=None):
    """x `[M, K]` (bf16 or fp32; rows sorted by group, group g's rows contiguous, groups in order
    0..E-1) times each group's expert of w transposed: `[M, N]` in x's dtype, rows past
    sum(group_sizes) zero.

    w: `[E, N, K]`, a plain array or a `QuantizedWeight` (dsv4_jax/model/quantized.py); with `layer`
    (int scalar, may be traced) the stack `[L, E, N, K]` of every layer, of which layer `layer`
    is used. group_sizes int32 `[E]`, sum <= M. The experts are dequantized (or cast) to x's
    dtype (value times scale in fp32, rounded once), the products accumulate in fp32."""
    if layer is not None:
        w = w[layer]
    w = w.dequantize(x.dtype) if hasattr(w, "fmt") else w.astype(x.dtype)
    # fp32 stays fp32 on every platform (a TPU's default would round the operands to bf16).
    precision = jax.lax.Precision.DEFAULT if x.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    y = jax.lax.ragged_dot_general(x, w, group_sizes.astype(jnp.int32), dims, precision=precision,
                                   preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def swiglu(h1, h3, limit: float):
    """The experts' activation: silu(min(h1, limit)) * clamp(h3, -limit, limit) in fp32 (no
    clamp when limit is 0)."""
    h1, h3 = h1.astype(jnp.float32), h3.astype(jnp.float32)
    if limit > 0:
        h1 = jnp.minimum(h1, limit)
        h3 = jnp.clip(h3, -limit, limit)
    return jax.nn.silu(h1) * h3


def grouped_swiglu_ref(x, w1, w3, group_sizes, hw, *, limit: float, layer=None):
    """`swiglu(grouped_matmul_ref(x, w1), grouped_matmul_ref(x, w3), limit) * hw` rounded to x's
    dtype: x `[M, K]` (rows sorted by group), w1 and w3 `[E, N, K]` (or stacks `[L, E, N, K]` with
    `layer`) as `grouped_matmul_ref` takes them, hw fp32 `[M]` the rows' routing weights -> `[M,
    N]`, rows past sum(group_sizes) zero (their hw, which may be unset, is not used)."""
    h = swiglu(grouped_matmul_ref(x, w1, group_sizes, layer=layer), grouped_matmul_ref(x, w3, group_sizes, layer=layer),
               limit)
    grouped = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(grouped[:, None], h * hw[:, None], 0.0).astype(x.dtype)
