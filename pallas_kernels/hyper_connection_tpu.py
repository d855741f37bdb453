"""The hyper-connections' two passes over the streams as Mosaic TPU kernels (also run by the
Pallas interpreter on CPU): each reads a tile of tokens' streams once and writes its result,
with the fp32 work on chip.

The streams `[B, S, hc, D]` reach the kernels as `[B * S, hc, D]`, a reshape of the untiled
leading axes that needs no re-layout in HBM (flattening each token's streams into `[hc * D]`
lanes would: TPU tiles the last two axes); stream j of a token tile is the strided load
x[:, j, :]. A token's per-stream weights (pre, post, comb: a few lanes of a `[tile, R]`
array) are taken out as `[tile, 1]` columns by a masked lane sum and broadcast over D.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._dispatch import layer_operand

LANES = 128
BLOCK_BYTES = 2 << 20  # target size of one tile of the streams in VMEM (fp32)
VMEM_LIMIT = 40 << 20
COLLAPSE_NAME = "dsv4_hc_collapse"
EXPAND_NAME = "dsv4_hc_expand"


def supported(d: int) -> bool:
    return d % LANES == 0


def tokens_per_step(n: int, width: int) -> int:
    """Token rows per grid step: a multiple of 16 (a bf16 tile) holding about BLOCK_BYTES of fp32
    streams `[rows, width]`, or all n."""
    rows = max(16, BLOCK_BYTES // (width * 4) // 16 * 16)
    return n if n <= rows else rows


def _column(a: jnp.ndarray, j: int) -> jnp.ndarray:
    """Lane j of a `[rows, lanes]` as `[rows, 1]`."""
    lane = lax.broadcasted_iota(jnp.int32, a.shape, 1)
    return jnp.sum(jnp.where(lane == j, a, 0.0), axis=-1, keepdims=True)


def _streams(x_ref, hc: int) -> list:
    return [x_ref[:, j, :].astype(jnp.float32) for j in range(hc)]


def _collapse_kernel(layer_ref, x_ref, fn_ref, sb_ref, c_ref, m_ref, *, hc: int, d: int, hc_eps: float,
                     norm_eps: float):
    del layer_ref  # (read by the index maps)
    xs = _streams(x_ref, hc)
    ss = functools.reduce(jnp.add, [jnp.sum(x * x, axis=-1, keepdims=True) for x in xs])
    inv = lax.rsqrt(ss / (hc * d) + norm_eps)
    contract = (((1,), (1,)), ((), ()))
    m = functools.reduce(jnp.add, [
        lax.dot_general(x * inv, fn_ref[:, pl.ds(j * d, d)], contract, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) for j, x in enumerate(xs)])
    m_ref[...] = m
    pre = 1.0 / (1.0 + jnp.exp(-(m * sb_ref[0:1, :] + sb_ref[1:2, :]))) + hc_eps
    out = functools.reduce(jnp.add, [_column(pre, j) * x for j, x in enumerate(xs)])
    c_ref[...] = out.astype(c_ref.dtype)


def hc_collapse_tpu(x, fn, base, scale, *, layer=None, hc_eps: float, norm_eps: float, interpret: bool = False,
                    block_tokens: int | None = None):
    """The contract of `hc_collapse_ref` (D a multiple of 128). With `layer` (an int scalar, may
    be traced), fn is the stack `[L, R, hc * D]` of every layer's, read in place (its index goes
    to fn's index map by scalar prefetch: the layer's fn sliced out of the stack, as an operand,
    would be a copy of it); base and scale are the layer's. block_tokens overrides the token rows
    per step (a multiple of 16, or >= B * S)."""
    if layer is None:  # one layer: a stack of one (a bitcast)
        fn = fn[None]
    bsz, s, hc, d = x.shape
    r = fn.shape[1]
    n = bsz * s
    width = hc * d
    tn = tokens_per_step(n, width) if block_tokens is None else min(block_tokens, n)
    # scale[0] and base as two rows of lanes: z = m * scale[0] + base, lane by lane
    sb = jnp.stack([jnp.broadcast_to(scale.astype(jnp.float32)[0], (r,)), base.astype(jnp.float32)])
    kernel = functools.partial(_collapse_kernel, hc=hc, d=d, hc_eps=float(hc_eps), norm_eps=float(norm_eps))
    rows = lambda i, l: (i, 0)  # noqa: E731
    # x once, the layer's fn and the two rows once (their block index never changes), both outputs
    read = n * width * x.dtype.itemsize + r * width * fn.dtype.itemsize + 2 * r * 4
    cost = pl.CostEstimate(flops=2 * n * r * width + 6 * n * width, transcendentals=n * r,
                           bytes_accessed=read + n * d * x.dtype.itemsize + n * r * 4)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(pl.cdiv(n, tn),),
        in_specs=[pl.BlockSpec((tn, hc, d), lambda i, l: (i, 0, 0)),
                  pl.BlockSpec((None, r, width), lambda i, l: (l[0], 0, 0)),
                  pl.BlockSpec((2, r), lambda i, l: (0, 0))],
        out_specs=[pl.BlockSpec((tn, d), rows), pl.BlockSpec((tn, r), rows)],
    )
    collapsed, m = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((n, d), x.dtype), jax.ShapeDtypeStruct((n, r), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=cost,
        interpret=interpret,
        name=COLLAPSE_NAME,
    )(layer_operand(layer), x.reshape(n, hc, d), fn, sb)
    return collapsed.reshape(bsz, s, d), m.reshape(bsz, s, r)


def _expand_kernel(f_ref, x_ref, post_ref, comb_ref, o_ref, *, hc: int):
    f = f_ref[...].astype(jnp.float32)
    post, comb = post_ref[...], comb_ref[...]
    xs = _streams(x_ref, hc)
    for k in range(hc):
        mixed = functools.reduce(jnp.add, [_column(comb, j * hc + k) * x for j, x in enumerate(xs)])
        o_ref[:, k, :] = (_column(post, k) * f + mixed).astype(o_ref.dtype)


def hc_expand_tpu(f, x, post, comb, *, interpret: bool = False, block_tokens: int | None = None):
    """The contract of `hc_expand_ref` (D a multiple of 128); block_tokens as `hc_collapse_tpu`'s."""
    bsz, s, hc, d = x.shape
    n = bsz * s
    width = hc * d
    tn = tokens_per_step(n, width) if block_tokens is None else min(block_tokens, n)
    rows, streams = (lambda i: (i, 0)), (lambda i: (i, 0, 0))
    nbytes = n * (d * f.dtype.itemsize + 2 * width * x.dtype.itemsize + (hc + hc * hc) * 4)
    out = pl.pallas_call(
        functools.partial(_expand_kernel, hc=hc),
        grid=(pl.cdiv(n, tn),),
        in_specs=[pl.BlockSpec((tn, d), rows), pl.BlockSpec((tn, hc, d), streams),
                  pl.BlockSpec((tn, hc), rows), pl.BlockSpec((tn, hc * hc), rows)],
        out_specs=pl.BlockSpec((tn, hc, d), streams),
        out_shape=jax.ShapeDtypeStruct((n, hc, d), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=pl.CostEstimate(flops=2 * n * width * (hc + 1), transcendentals=0, bytes_accessed=nbytes),
        interpret=interpret,
        name=EXPAND_NAME,
    )(f.reshape(n, d), x.reshape(n, hc, d), post.astype(jnp.float32).reshape(n, hc),
      comb.astype(jnp.float32).reshape(n, hc * hc))
    return out.reshape(bsz, s, hc, d)
