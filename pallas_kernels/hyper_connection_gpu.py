"""The hyper-connections' two passes over the streams as GPU kernels (Hopper), written in
Pallas-Triton (also run by the Pallas interpreter on CPU).

Why kernels: XLA:GPU computes the reference's fp32 work on the streams `[B, S, hc, D]` as
several fusions and writes fp32 copies of the streams between them (the normalised streams
before the mixes' product, the expanded streams before their cast to the storage dtype and the
next collapse's sum of squares): twice and more the bytes of the bf16 streams themselves, in
both passes of both sub-layers of every layer of a prefill chunk (docs/plan.md has the bytes).
Here the fp32 values live in registers.

`hc_collapse_gpu`, two kernels and a few ops on `[N, R]` between them (N = B S tokens):
  * the mixes (`MIXES_NAME`): grid `(ceil(N / TT), hc * ceil(D / BK))`, a program multiplies one
    stream's column chunk of TT tokens `[TT, BK]` by the same columns of fn `[RP, BK]` (the
    layer's, read in place in the stack; tensor cores, fp32 in IEEE) and sums the chunk's
    squares, writing both as partials (fp32 `[hc * ceil(D / BK), N, R]` and `[..., N]`). Split
    along the streams' columns so that a decode step's few tokens still spread over the SMs. RP
    is R rounded up to a power of two and TT is 16 (the MMA's smallest side).
  * XLA sums the partials: m = mixes / rms, and the pre weights.
  * the sum (`SUM_NAME`): grid `(N, ceil(D / BD))`, one token's BD columns a program:
    sum_j pre_j x_j.
The streams are read twice (once a pass), and no fp32 copy of them is written.

`hc_expand_gpu`: grid `(N, ceil(D / BD))`, one token's BD columns a program: its streams' and
f's columns in, post_k f + sum_j comb[j, k] x_j out for each k, the per-token weights loaded
as scalars. Every byte is read and written once.

Numerics (fp32, as the reference): the mixes are the streams' product with fn, summed over the
chunks and then scaled by the tokens' 1 / rms (the reference scales the streams first and
contracts once: equal up to fp32 rounding); the collapse and the expansion sum the streams in
the reference's order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._dispatch import declared_cost_scope, layer_operand
from .hyper_connection_ref import pre_weights
from .quantized_matmul_gpu import MIN_ROWS, _pow2_at_least

MIXES_NAME = "dsv4_hc_mixes_gpu"
SUM_NAME = "dsv4_hc_sum_gpu"
EXPAND_NAME = "dsv4_hc_expand_gpu"
TOKENS = 16  # the mixes: tokens per program (the MMA's smallest tile side)
MIXES_BK = 256  # the mixes: columns of one stream per program
STREAM_BD = 1024  # the sum and the expansion: columns of one token per program


def _at(i: int):
    """A static index into a ref, as an int32 scalar (the interpreter's load takes no Python int
    beside a slice)."""
    return jnp.int32(i)


def mixes_cost(n: int, hc: int, d: int, r: int, parts: int, itemsize: int, fn_itemsize: int) -> pl.CostEstimate:
    """The mixes' kernel: the products' flops; the streams and fn read once, the `parts` partial
    mixes and sums of squares written once."""
    width = hc * d
    return pl.CostEstimate(flops=2 * n * r * width + 2 * n * width, transcendentals=0,
                           bytes_accessed=n * width * itemsize + r * width * fn_itemsize + parts * n * (r + 1) * 4)


def sum_cost(n: int, hc: int, d: int, itemsize: int) -> pl.CostEstimate:
    """The collapse's sum: the streams and the pre weights read once, the collapsed streams
    written once."""
    return pl.CostEstimate(flops=2 * n * hc * d, transcendentals=0,
                           bytes_accessed=n * (hc * d * itemsize + hc * 4 + d * itemsize))


def expand_cost(n: int, hc: int, d: int, itemsize: int, f_itemsize: int) -> pl.CostEstimate:
    """The expansion: f and the streams read once, the streams written once, the per-token
    weights read once."""
    return pl.CostEstimate(flops=2 * n * hc * d * (hc + 1), transcendentals=0,
                           bytes_accessed=n * (d * f_itemsize + 2 * hc * d * itemsize + (hc + hc * hc) * 4))


def _mixes_kernel(layer_ref, x_ref, fn_ref, acc_ref, ss_ref, *, n: int, d: int, r: int, rp: int, bk: int,
                  chunks: int):
    f32, i32 = jnp.float32, jnp.int32
    i, p = pl.program_id(0), pl.program_id(1)
    j, c = p // chunks, p % chunks  # stream j's column chunk c
    layer = pltriton.load(layer_ref.at[_at(0)])
    rows = i * TOKENS + jax.lax.broadcasted_iota(i32, (TOKENS, 1), 0)
    cols = c * bk + jax.lax.broadcasted_iota(i32, (1, bk), 1)
    mixes = jax.lax.broadcasted_iota(i32, (rp, 1), 0)
    x = pltriton.load(x_ref.at[pl.ds(i * TOKENS, TOKENS), j, pl.ds(c * bk, bk)], mask=(rows < n) & (cols < d),
                      other=0).astype(f32)
    w = pltriton.load(fn_ref.at[layer, pl.ds(0, rp), pl.ds(j * d + c * bk, bk)], mask=(mixes < r) & (cols < d),
                      other=0).astype(f32)
    acc = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=f32)
    lanes = jax.lax.broadcasted_iota(i32, (1, rp), 1)
    pltriton.store(acc_ref.at[p, pl.ds(i * TOKENS, TOKENS), pl.ds(0, rp)], acc, mask=(rows < n) & (lanes < r))
    pltriton.store(ss_ref.at[p, pl.ds(i * TOKENS, TOKENS)], jnp.sum(x * x, axis=1), mask=rows[:, 0] < n)


def _sum_kernel(x_ref, pre_ref, o_ref, *, hc: int, d: int, bd: int):
    t, c = pl.program_id(0), pl.program_id(1)
    ok = c * bd + jax.lax.iota(jnp.int32, bd) < d
    terms = [pltriton.load(pre_ref.at[t, _at(j)])
             * pltriton.load(x_ref.at[t, _at(j), pl.ds(c * bd, bd)], mask=ok, other=0).astype(jnp.float32)
             for j in range(hc)]
    pltriton.store(o_ref.at[t, pl.ds(c * bd, bd)], functools.reduce(jnp.add, terms).astype(o_ref.dtype), mask=ok)


def hc_mixes_gpu(x, fn, *, layer=None, interpret: bool = False):
    """The mixes kernel: x `[B, S, hc, D]`, fn `[R, hc * D]` (with `layer`, an int scalar that may
    be traced: the stack `[L, R, hc * D]`, its layer read in place) -> the partial products of
    the streams with fn, fp32 `[P, N, R]`, and the partial sums of their squares, fp32 `[P, N]`
    (P = hc ceil(D / BK) column chunks, N = B S)."""
    if layer is None:  # one layer: a stack of one (a bitcast)
        fn = fn[None]
    bsz, s, hc, d = x.shape
    r = fn.shape[1]
    n = bsz * s
    rp = _pow2_at_least(r, MIN_ROWS)
    bk = min(MIXES_BK, _pow2_at_least(d, MIN_ROWS))
    chunks = pl.cdiv(d, bk)
    cost = mixes_cost(n, hc, d, r, hc * chunks, x.dtype.itemsize, fn.dtype.itemsize)
    with declared_cost_scope(cost):
        return pl.pallas_call(
            functools.partial(_mixes_kernel, n=n, d=d, r=r, rp=rp, bk=bk, chunks=chunks),
            grid=(pl.cdiv(n, TOKENS), hc * chunks),
            out_shape=[jax.ShapeDtypeStruct((hc * chunks, n, r), jnp.float32),
                       jax.ShapeDtypeStruct((hc * chunks, n), jnp.float32)],
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            cost_estimate=cost,
            interpret=interpret,
            name=MIXES_NAME,
        )(layer_operand(layer), x.reshape(n, hc, d), fn)


def hc_sum_gpu(x, pre, *, interpret: bool = False):
    """The sum kernel: x `[B, S, hc, D]`, pre fp32 `[B, S, hc]` -> sum_j pre_j x_j `[B, S, D]` in
    x's dtype."""
    bsz, s, hc, d = x.shape
    n = bsz * s
    bd = min(STREAM_BD, _pow2_at_least(d, MIN_ROWS))
    cost = sum_cost(n, hc, d, x.dtype.itemsize)
    with declared_cost_scope(cost):
        out = pl.pallas_call(
            functools.partial(_sum_kernel, hc=hc, d=d, bd=bd),
            grid=(n, pl.cdiv(d, bd)),
            out_shape=jax.ShapeDtypeStruct((n, d), x.dtype),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            cost_estimate=cost,
            interpret=interpret,
            name=SUM_NAME,
        )(x.reshape(n, hc, d), pre.astype(jnp.float32).reshape(n, hc))
    return out.reshape(bsz, s, d)


def hc_collapse_gpu(x, fn, base, scale, *, layer=None, hc_eps: float, norm_eps: float, interpret: bool = False):
    """The contract of `hc_collapse_ref`; with `layer` (an int scalar, may be traced), fn is the
    stack `[L, R, hc * D]` of every layer's, read in place, and base and scale are the layer's.
    Any D (masked tails). interpret: run in the Pallas interpreter (CPU)."""
    bsz, s, hc, d = x.shape
    acc, ss = hc_mixes_gpu(x, fn, layer=layer, interpret=interpret)
    m = jnp.sum(acc, axis=0) * jax.lax.rsqrt(jnp.sum(ss, axis=0) / (hc * d) + norm_eps)[:, None]  # [N, R]
    m = m.reshape(bsz, s, -1)
    return hc_sum_gpu(x, pre_weights(m, base, scale, hc, hc_eps), interpret=interpret), m


def _expand_kernel(f_ref, x_ref, post_ref, comb_ref, o_ref, *, hc: int, d: int, bd: int):
    t, c = pl.program_id(0), pl.program_id(1)
    cols = c * bd + jax.lax.iota(jnp.int32, bd)
    ok = cols < d
    f = pltriton.load(f_ref.at[t, pl.ds(c * bd, bd)], mask=ok, other=0).astype(jnp.float32)
    xs = [pltriton.load(x_ref.at[t, _at(j), pl.ds(c * bd, bd)], mask=ok, other=0).astype(jnp.float32)
          for j in range(hc)]
    for k in range(hc):
        mixed = functools.reduce(jnp.add, [pltriton.load(comb_ref.at[t, _at(j * hc + k)]) * x
                                           for j, x in enumerate(xs)])
        out = pltriton.load(post_ref.at[t, _at(k)]) * f + mixed
        pltriton.store(o_ref.at[t, _at(k), pl.ds(c * bd, bd)], out.astype(o_ref.dtype), mask=ok)


def hc_expand_gpu(f, x, post, comb, *, interpret: bool = False):
    """The contract of `hc_expand_ref` (any D). interpret: run in the Pallas interpreter (CPU)."""
    bsz, s, hc, d = x.shape
    n = bsz * s
    bd = min(STREAM_BD, _pow2_at_least(d, MIN_ROWS))
    cost = expand_cost(n, hc, d, x.dtype.itemsize, f.dtype.itemsize)
    with declared_cost_scope(cost):
        out = pl.pallas_call(
            functools.partial(_expand_kernel, hc=hc, d=d, bd=bd),
            grid=(n, pl.cdiv(d, bd)),
            out_shape=jax.ShapeDtypeStruct((n, hc, d), x.dtype),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            cost_estimate=cost,
            interpret=interpret,
            name=EXPAND_NAME,
        )(f.reshape(n, d), x.reshape(n, hc, d), post.astype(jnp.float32).reshape(n, hc),
          comb.astype(jnp.float32).reshape(n, hc * hc))
    return out.reshape(bsz, s, hc, d)
