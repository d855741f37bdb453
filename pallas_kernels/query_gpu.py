"""The attention's queries made ready on GPU (Hopper): each head scaled by its unweighted RMS,
then its last dims rotated at its token's position, in one pass, written in Pallas-Triton (also
run by the Pallas interpreter on CPU).

Why a kernel: in XLA:GPU the per-head norm and the rotation are two fusions over the chunk's
queries `[T, H, D]` (the norm's output written out and read back by the rotation's
concatenation): twice the queries' bytes read and written, in every layer of a prefill chunk.
Here each row is read once and written once. (On TPU the attention kernel does both itself.)

Grid `(ceil(R / TR),)` over the R = B T H rows of D values (one head of one token), TR rows a
program: the row loaded whole (D up to a power of two, masked), its mean square summed in fp32,
the factor rounded to q's dtype and the product rounded once (`unweighted_rms_norm`); the RoPE
dims loaded again as their even and odd members (the row is in L1 already; rope/2 up to a power
of two, masked), scaled the same way,
rotated in fp32 by the token's cos and sin (`apply_rope`) and interleaved back into pairs in
registers (Triton's join), then stored after the NoPE dims.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._dispatch import declared_cost_scope
from .quantized_matmul_gpu import MIN_ROWS, _pow2_at_least

NAME = "dsv4_query_norm_rope_gpu"
ROWS = 16  # rows (heads of a token) per program


def cost_estimate(rows: int, tokens: int, d: int, half: int, itemsize: int) -> pl.CostEstimate:
    """Each row read and written once, each token's cos and sin read once."""
    return pl.CostEstimate(flops=rows * (3 * d + 6 * half), transcendentals=rows,
                           bytes_accessed=2 * rows * d * itemsize + 2 * tokens * half * 4)


def _kernel(q_ref, cos_ref, sin_ref, o_ref, *, rows: int, heads: int, d: int, half: int, eps: float):
    i = pl.program_id(0)
    tr, dp, hp = ROWS, _pow2_at_least(d, MIN_ROWS), _pow2_at_least(half, 1)
    r = i * tr + jax.lax.iota(jnp.int32, tr)
    ok = r < rows
    cols = jax.lax.iota(jnp.int32, dp)
    x = pltriton.load(q_ref.at[r[:, None], cols[None, :]], mask=ok[:, None] & (cols < d)[None, :], other=0)
    xf = x.astype(jnp.float32)
    factor = jax.lax.rsqrt(jnp.sum(xf * xf, axis=1) / d + eps).astype(x.dtype).astype(jnp.float32)[:, None]
    nope = d - 2 * half
    pltriton.store(o_ref.at[r[:, None], cols[None, :]], (xf * factor).astype(o_ref.dtype),
                   mask=ok[:, None] & (cols < nope)[None, :])
    pair = jax.lax.iota(jnp.int32, hp)
    pairs = ok[:, None] & (pair < half)[None, :]
    token = r // heads
    cos = pltriton.load(cos_ref.at[token[:, None], pair[None, :]], mask=pairs, other=0)
    sin = pltriton.load(sin_ref.at[token[:, None], pair[None, :]], mask=pairs, other=0)

    def member(j):  # the pairs' j-th members, normalized (rounded to q's dtype), in fp32 `[TR, hp]`
        v = pltriton.load(q_ref.at[r[:, None], (nope + 2 * pair + j)[None, :]], mask=pairs, other=0)
        return (v.astype(jnp.float32) * factor).astype(x.dtype).astype(jnp.float32)

    re, im = member(0), member(1)
    rotated = jnp.stack([re * cos - im * sin, im * cos + re * sin], axis=-1).reshape(tr, 2 * hp)
    at = jax.lax.iota(jnp.int32, 2 * hp)
    pltriton.store(o_ref.at[r[:, None], (nope + at)[None, :]], rotated.astype(o_ref.dtype),
                   mask=ok[:, None] & (at < 2 * half)[None, :])


def query_norm_rope_gpu(q, query_rope, *, eps: float, interpret: bool = False):
    """q `[B, T, H, D]` and query_rope = (cos, sin) fp32 `[B, T, rope/2]` (rope <= D) ->
    `[B, T, H, D]` in q's dtype: `rotate_heads(unweighted_rms_norm(q, eps), query_rope)`."""
    cos, sin = query_rope
    bsz, t, h, d = q.shape
    half = cos.shape[-1]
    rows = bsz * t * h
    cost = cost_estimate(rows, bsz * t, d, half, q.dtype.itemsize)
    with declared_cost_scope(cost):
        out = pl.pallas_call(
            functools.partial(_kernel, rows=rows, heads=h, d=d, half=half, eps=float(eps)),
            grid=(pl.cdiv(rows, ROWS),),
            out_shape=jax.ShapeDtypeStruct((rows, d), q.dtype),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            cost_estimate=cost,
            interpret=interpret,
            name=NAME,
        )(q.reshape(rows, d), cos.astype(jnp.float32).reshape(bsz * t, half),
          sin.astype(jnp.float32).reshape(bsz * t, half))
    return out.reshape(bsz, t, h, d)
