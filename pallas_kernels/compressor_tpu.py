"""KV compressor (gated pooling + RMSNorm + interleaved RoPE): the Mosaic TPU kernel (also run
by the Pallas interpreter on CPU).

a and z keep their natural layout [B, L = n * ratio, C] (tokens on sublanes, features on lanes),
so no relayout copy is needed in HBM. One grid step produces TN entries from a [TN * ratio, C]
tile of a and of z, which reaches the kernel as C / 128 lane columns: the same array is passed
once per 128-lane column, each with a [TN * ratio, 128] block. (Mosaic's strided load, below,
only reads a buffer exactly 128 lanes wide.) Candidate r of all TN entries in a column is one
strided sublane load (rows r, r + ratio, r + 2 ratio, ...), giving a [TN, 128] slab; the softmax
over candidates is then plain elementwise work across slabs, column by column:
  * ratio 128: 128 candidates, own block only (three passes over the slabs: max, sum, weighted sum);
  * ratio 4: this block's tokens (second-half features) and the previous block's tokens
    (first-half features). The previous block of entry j is entry j-1 of the same slab (a
    sublane roll by one); for the first entry of the tile it comes from a small extra operand:
    the 8 token rows just before the tile (the tile's "tail"), or prev_a / prev_z on the first
    tile.
The pooled entry is rounded to out_dtype, RMS-normalised (fp32 inside), and its last lane column
(128 lanes, which hold the rope dims) rotated: pairs are swapped with two lane rolls, and the
wrapper supplies cos / signed sin expanded to that lane column (1 / 0 on the non-rope lanes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
BLOCK_BYTES = 2 << 20  # target size of one a (or z) tile in VMEM
VMEM_LIMIT = 40 << 20


def entries_per_step(n: int, ratio: int, c: int) -> int:
    """TN: a multiple of 16 (a bf16 output tile) sized to about BLOCK_BYTES of fp32 input, or n."""
    tn = max(16, min(256, BLOCK_BYTES // (ratio * c * 4)) // 16 * 16)
    return n if n <= tn else tn


def _kernel(*refs, ratio: int, d: int, tn: int, eps: float, tail_off: int):
    nc = (2 * d if ratio == 4 else d) // LANES  # lane columns of a and z
    a_cols, z_cols = refs[:nc], refs[nc:2 * nc]
    pa_ref, pz_ref, ta_ref, tz_ref, w_ref, cos_ref, sin_ref, o_ref = refs[2 * nc:]
    overlap = ratio == 4
    f32 = jnp.float32
    out_cols = range(d // LANES)

    def cur(col, r):  # candidate r of every entry in the tile, one lane column: [TN, 128]
        return col[pl.ds(r, tn, stride=ratio), :].astype(f32)

    if overlap:
        i = pl.program_id(1)
        first = lax.broadcasted_iota(jnp.int32, (tn, LANES), 0) == 0

        def before(col, p_ref, t_ref, r, c):
            # Block j-1's token r (first-half features, column c) for every entry j of the tile.
            x = pltpu.roll(cur(col, r), 1, 0) if tn > 1 else cur(col, r)
            lanes = pl.ds(c * LANES, LANES)
            edge = jnp.where(i == 0, p_ref[pl.ds(r, 1), lanes].astype(f32),
                             t_ref[pl.ds(tail_off + r, 1), lanes].astype(f32))
            return jnp.where(first, edge, x)

        def pool(c):  # the 8 candidates of output column c: block j-1's first half, block j's second
            nh = d // LANES
            zs = ([before(z_cols[c], pz_ref, tz_ref, r, c) for r in range(4)]
                  + [cur(z_cols[nh + c], r) for r in range(4)])
            m = functools.reduce(jnp.maximum, zs)
            es = [jnp.exp(zr - m) for zr in zs]
            s = functools.reduce(jnp.add, es)
            avals = ([before(a_cols[c], pa_ref, ta_ref, r, c) for r in range(4)]
                     + [cur(a_cols[nh + c], r) for r in range(4)])
            return functools.reduce(jnp.add, [ar * (er / s) for ar, er in zip(avals, es)])
    else:
        def pool(c):
            a_col, z_col = a_cols[c], z_cols[c]
            m = lax.fori_loop(1, ratio, lambda r, acc: jnp.maximum(acc, cur(z_col, r)), cur(z_col, 0))
            s = lax.fori_loop(0, ratio, lambda r, acc: acc + jnp.exp(cur(z_col, r) - m), jnp.zeros((tn, LANES), f32))
            return lax.fori_loop(
                0, ratio, lambda r, acc: acc + cur(a_col, r) * (jnp.exp(cur(z_col, r) - m) / s),
                jnp.zeros((tn, LANES), f32))

    xs = [pool(c).astype(o_ref.dtype).astype(f32) for c in out_cols]
    ms = functools.reduce(jnp.add, [jnp.sum(x * x, axis=-1, keepdims=True) for x in xs]) / d
    inv = lax.rsqrt(ms + eps)
    for c, x in zip(out_cols, xs):
        lanes = pl.ds(c * LANES, LANES)
        y = (w_ref[:, lanes].astype(f32) * (x * inv)).astype(o_ref.dtype)
        if c == len(xs) - 1:  # the rope column: out = y * cos + swap_pairs(y) * signed_sin
            yr = y.astype(f32)
            even = lax.broadcasted_iota(jnp.int32, yr.shape, 1) % 2 == 0
            swapped = jnp.where(even, pltpu.roll(yr, LANES - 1, 1), pltpu.roll(yr, 1, 1))
            y = (yr * cos_ref[...] + swapped * sin_ref[...]).astype(o_ref.dtype)
        o_ref[:, lanes] = y


def supported(d: int, rope: int) -> bool:
    return d % LANES == 0 and 0 < rope <= LANES and rope % 2 == 0


def compress_tpu(a, z, norm_weight, cos, sin, *, ratio: int, eps: float, prev_a=None, prev_z=None,
                 out_dtype=jnp.float32, interpret: bool = False, block_entries: int | None = None):
    """Same contract as `compress_ref` (d a multiple of 128, rope dims <= 128); the Mosaic TPU
    kernel (interpret=True: the Pallas interpreter, any platform). block_entries overrides TN
    (a multiple of 16, or >= n)."""
    bsz, length, c = a.shape
    n = length // ratio
    overlap = ratio == 4
    d = c // 2 if overlap else c
    half = cos.shape[-1]
    if not supported(d, 2 * half):
        raise ValueError(f"compress_tpu needs d % 128 == 0 and rope <= 128, got d={d}, rope={2 * half}")
    if n == 0:
        return jnp.zeros((bsz, 0, d), out_dtype)
    a = a[:, : n * ratio].astype(jnp.float32)
    z = z[:, : n * ratio].astype(jnp.float32)
    tn = entries_per_step(n, ratio, c) if block_entries is None else min(block_entries, n)
    steps = pl.cdiv(n, tn)
    rows = tn * ratio

    # cos and signed sin on the last 128 lanes, pair-expanded (1 and 0 on the non-rope lanes).
    pad = LANES - 2 * half
    cos2 = jnp.repeat(cos.astype(jnp.float32), 2, axis=-1)
    sin2 = jnp.repeat(sin.astype(jnp.float32), 2, axis=-1) * jnp.tile(jnp.array([-1.0, 1.0], jnp.float32), half)
    cos2 = jnp.concatenate([jnp.ones((bsz, n, pad), jnp.float32), cos2], axis=-1)
    sin2 = jnp.concatenate([jnp.zeros((bsz, n, pad), jnp.float32), sin2], axis=-1)

    tile = lambda b, i: (b, i, 0)
    nc = c // LANES
    columns = [pl.BlockSpec((None, rows, LANES), lambda b, i, k=k: (b, i, k)) for k in range(nc)]
    in_specs = columns + columns
    operands = [a] * nc + [z] * nc
    if overlap:
        if prev_a is None:
            pa = jnp.zeros((bsz, ratio, c), jnp.float32)
            pz = jnp.full((bsz, ratio, c), -jnp.inf, jnp.float32)
        else:
            pa, pz = prev_a.astype(jnp.float32), prev_z.astype(jnp.float32)
        prev_spec = pl.BlockSpec((None, ratio, c), lambda b, i: (b, 0, 0))
        if steps > 1:  # the 8 token rows before tile i (rows 4..7 are block j-1 of its first entry)
            tail_spec = pl.BlockSpec((None, 8, c), lambda b, i: (b, jnp.maximum(i * (rows // 8) - 1, 0), 0))
            tails, tail_off = [a, z], 4
        else:  # never read: the single tile takes its edge from prev
            tail_spec, tails, tail_off = prev_spec, [pa, pz], 0
        in_specs += [prev_spec, prev_spec, tail_spec, tail_spec]
        operands += [pa, pz] + tails
    else:
        dummy = jnp.zeros((8, LANES), jnp.float32)
        in_specs += [pl.BlockSpec((8, LANES), lambda b, i: (0, 0))] * 4
        operands += [dummy] * 4
        tail_off = 0
    in_specs += [pl.BlockSpec((1, d), lambda b, i: (0, 0)),
                 pl.BlockSpec((None, tn, LANES), tile), pl.BlockSpec((None, tn, LANES), tile)]
    operands += [norm_weight.reshape(1, d), cos2, sin2]

    kernel = functools.partial(_kernel, ratio=ratio, d=d, tn=tn, eps=float(eps), tail_off=tail_off)
    # What the pipeline moves: a and z once, prev once per batch row, the tile-edge rows per step,
    # cos / sin on 128 lanes, the weight once, the output.
    edge_rows = (ratio if overlap else 0) + (8 * steps if overlap and steps > 1 else 0)
    read = 2 * (a.size + bsz * edge_rows * c) * 4 + 2 * cos2.size * 4 + d * norm_weight.dtype.itemsize
    cost = pl.CostEstimate(flops=6 * bsz * length * c, transcendentals=2 * bsz * length * c,
                           bytes_accessed=read + bsz * n * d * jnp.dtype(out_dtype).itemsize)
    return pl.pallas_call(
        kernel,
        grid=(bsz, steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, tn, d), tile),
        out_shape=jax.ShapeDtypeStruct((bsz, n, d), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=cost,
        interpret=interpret,
        name="dsv4_compress",
    )(*operands)
