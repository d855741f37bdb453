"""Rows grouped by expert times each group's expert weight: the GPU kernel (Pallas-Triton, for
Hopper, sm_90a), also run by the Pallas interpreter on CPU.

Why Pallas-Triton and not Mosaic GPU: the products want the tensor cores (a 512-token
prefill's top-6 rows times one of Flash's expert matrices is ~50 GFLOP), and the weight arrives
as FP4 or FP8 bytes that must be dequantized between the load and the product. Triton's dot
takes its operands from registers in whatever layout the loads left them, so the dequantization
is plain elementwise code on the loaded tile (the PTX has mma.sync m16n8k16 bf16 products; wgmma
would need 64-row tiles, more than decode's groups have). Mosaic GPU's wgmma (jax 0.10.2) wants
both operands in tiled, swizzled SMEM, so each dequantized tile would go back through SMEM in
that layout, and the repo's Mosaic GPU kernels use no tensor cores at all (mgpu_probe.py). This
kernel compiles ahead of time for sm_90a (tests/test_grouped_matmul_gpu.py). Consequences: the
compiled program holds a `__gpu$xla.gpu.triton` custom call (op_name ".../<name>/pallas_call",
the kernel named "dsv4_grouped_matmul_gpu"), not a Mosaic GPU one; and the Triton lowering drops
the `pl.CostEstimate` declared on the pallas_call, so `cost_estimate` exposes it to callers and
the op_name carries it (`_dispatch.declared_cost_scope`: what dsv4-plan counts).

Inputs as `grouped_matmul_tpu` takes them (`dsv4_jax/model/quantized.py` formats): x `[M, K]` (bf16 or
fp32) holds the rows sorted by expert (group g's rows contiguous, groups in order); group_sizes
`[E]`; the weights as stored: plain `[E, N, K]`, FP8 e4m3 `[E, N, K]` with float32 scales
`[E, ceil(N/128), ceil(K/128)]`, or FP4 uint8 `[E, N, K/2]` (two e2m1 codes a byte, element 2j
in byte j's low nibble) with E8M0 scale bytes `[E, N, ceil(K/32)]`; with `layer`, the stack of
every layer `[L, E, ...]`, indexed by a traced layer number inside the kernel (a layer sliced out
would be copied whole first).

Grid `(N / TN, steps)`. Row tiles are cut per group, not at multiples of TM: group g's rows
are split into ceil(size_g / TM) tiles from its first row (the last one cut at the group's end),
so no tile holds two groups and a group of at most TM rows has its expert read once per call.
(Tiles on TM multiples, as on TPU, would make a group that straddles a boundary read its expert
twice: at prefill, groups of ~12 rows and TM 16, most of them.) After the groups' tiles come the
tiles of the rows past sum(group_sizes), stored as zeros, then steps that do nothing. `steps` is
a static bound: ceil(s / TM) summed over those at most min(E, M) + 1 parts of M rows is at most
`ceil(M / TM) + min(E, M)`. Metadata computed outside the kernel (`_metadata`, int32 arrays
passed as inputs: Triton has no scalar prefetch) gives each step its first row, the end of its
rows and its group; a program reads those scalars and addresses the weight with them. Empty
groups get no step, so no byte of an expert no row chose is read.

A computing program (column tile j, step t) streams its expert's `[TN, K]` column tile through
the K loop, BK values at a time (FP4: BK / 2 code bytes), dequantizes each `[TN, BK]` piece in
registers exactly as `QuantizedWeight.dequantize` does (value times scale in float32, rounded
once to x's dtype) and accumulates `[TM, TN]` in fp32 on the tensor cores. So each chosen
expert's values and scales are read once per row tile of its group, and x's rows once per
column tile. Loads and stores are masked: rows outside the tile's group (and past M), columns
past N and K (those two only where the static shapes leave a partial tile: none at Flash's);
masked weight values become zeros after the cast (padding must never meet a value: an e4m3 NaN
times zero is NaN).

FP4: a byte's two nibbles are decoded apart (low and high, `[TN, BK / 2]` each, the piece's
scales `[TN, BK / 32]` broadcast over their 16 bytes each) and interleaved in registers (a
stack on the last axis and a reshape: Triton's join) into x's column order, so x's piece is one
contiguous `[TM, BK]` load (cp.async-pipelined) and one product. FP8: BK divides 128, so a piece
lies in one 128-column scale block; with TN <= 128 also in one 128-row block (one scalar
scale), else each weight row takes its block's scale (a `[TN]` gather of a few values).

Tiles (`tiles`, a static choice from M and E: the average group M / min(E, M) rows):
* under 32 rows on average (decode, prefills spread over many experts): TM twice the average
  as a power of two in [16, 64] (decode: 16, the smallest tensor-core tile; mma.sync), 4
  warps, BK 128; TN 64 at TM 16 keeps the decode grid wide (N / 64 column tiles per chosen
  expert: 32 x 48 programs for Flash w1 at 8 tokens), 128 above (x read half as often).
* from 32 rows on (prefill, and expert parallelism's large local groups): TM 128, TN 256, 8
  warps (wgmma, two warpgroups of 64 x 256; the fp32 accumulator is 128 registers a thread),
  BK 64 (FP8: 32). A call reads each expert ~size / TM + 1 times and x N / TN times: per
  product value 2 / TN bytes of bf16 x against ~0.53 / TM of FP4 weight (FP8 1 / TM), so with
  TM x TN fixed by the registers, the wider TN reads the least (TM 256 x TN 128 reads each
  expert half as often but x twice as often: more bytes in all at Flash's shapes). 256 x 256
  would need 256 accumulator registers a thread.
ptxas (12.9, sm_90a; tests/test_grouped_matmul_gpu.py checks): no spills at any of them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from ._dispatch import declared_cost_scope, layer_operand
from .grouped_matmul_tpu import _e2m1, _e8m0, operand_shapes  # the bit-exact decodes (plain jnp), the shape checks
from .quantized_matmul_gpu import L2_BYTES

NAME = "dsv4_grouped_matmul_gpu"
FP8_BLOCK = 128
FP4_GROUP = 32  # values per E8M0 scale (16 bytes)
MIN_TM, MAX_SMALL_TM = 16, 64
LARGE_GROUP = 32  # average rows per chosen expert from which the large tiles serve
NUM_STAGES = 3


class Tiles(NamedTuple):
    tm: int  # rows per step (one group's)
    tn: int  # weight rows (output columns) per program
    bk: int  # stored values per K step (FP4: bk // 2 bytes)
    num_warps: int


# Large groups (prefill): 128 x 256 tiles over 8 warps (the fp32 accumulator is 128 registers a
# thread) and K pieces of 64 values (FP8: 32, its piece is dequantized in fp32), which keeps the
# dequantized piece within the registers left (ptxas, sm_90a: 193 FP4, 218 FP8, no spills).
LARGE = Tiles(tm=128, tn=256, bk=64, num_warps=8)
LARGE_FP8_BK = 32


def tiles(m: int, e: int, fmt: str | None = None) -> Tiles:
    """The static tile choice (module docstring, Tiles) from M and E (group sizes are traced):
    by the rows a chosen expert gets on average, M / min(E, M). Under LARGE_GROUP, TM twice that
    as a power of two in [16, 64] (a group larger than TM is read once per TM of its rows, and
    the rows of a tile past its group are masked off, computed for nothing, so TM leaves room
    above the average); from LARGE_GROUP, `LARGE` (at Flash's 512-token prefill over 8 GPUs,
    768 rows an expert: each expert read ~7 times instead of ~13, x 8 or 16 times instead of 32
    or 64)."""
    per_group = pl.cdiv(m, max(1, min(e, m)))
    if per_group >= LARGE_GROUP:
        return LARGE._replace(bk=LARGE_FP8_BK) if fmt == "fp8" else LARGE
    tm = MIN_TM
    while tm < min(2 * per_group, MAX_SMALL_TM):
        tm *= 2
    return Tiles(tm=tm, tn=64 if tm == MIN_TM else 128, bk=128, num_warps=4)


def row_tile(m: int, e: int) -> int:
    """TM (`tiles`)."""
    return tiles(m, e).tm


def max_steps(m: int, e: int, tm: int) -> int:
    """The static grid bound along the steps: the row tiles of the groups with rows and of the
    rows past them, ceil(s / TM) for each of those (at most min(E, M) + 1) parts of M rows,
    which sum to at most ceil(M / TM) + parts - 1."""
    return pl.cdiv(m, tm) + max(1, min(e, m))


def _metadata(group_sizes, m: int, tm: int, steps: int):
    """Per step, int32 `[steps]` each: its first row, the end of its group's rows (exclusive),
    its group; and `[2]`: the steps that compute, those plus the steps that zero the rows past
    sum(group_sizes). A group's tiles start at its first row (TM rows each, the last cut at
    the group's end), so no tile is shared by two groups; the zeroing steps' tiles start at
    row sum(group_sizes) and end at M. Later steps do nothing."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    total = ends[-1]
    count = (sizes + tm - 1) // tm
    done = jnp.cumsum(count)  # steps through each group
    n_real = done[-1]
    t = jnp.arange(steps, dtype=jnp.int32)
    # Clamped: steps past the computing ones must still index the arrays.
    group = jnp.minimum(jnp.searchsorted(done, t, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
    real = t < n_real
    start = jnp.where(real, ends[group] - sizes[group] + (t - done[group] + count[group]) * tm,
                      total + (t - n_real) * tm)
    end = jnp.where(real, ends[group], m)
    live = jnp.stack([n_real, n_real + (jnp.maximum(m - total, 0) + tm - 1) // tm])
    return start.astype(jnp.int32), end.astype(jnp.int32), group, live.astype(jnp.int32)


def dsv4_grouped_matmul_gpu(start_ref, end_ref, group_ref, live_ref, layer_ref, x_ref, v_ref, *refs,
                            fmt: str | None, k: int, tiles: Tiles, layered: bool):
    """One (column tile, step) program; Triton names the kernel after this function."""
    tm, tn, bk = tiles.tm, tiles.tn, tiles.bk
    o_ref = refs[-1]
    s_ref = refs[0] if fmt is not None else None
    m, n = o_ref.shape
    j, t = pl.program_id(0), pl.program_id(1)
    cols = j * tn + jax.lax.iota(jnp.int32, tn)
    col_ok = cols < n
    first = start_ref[t]
    rows = first + jax.lax.iota(jnp.int32, tm)
    mine = (rows < end_ref[t]) & (rows < m)
    out_at = o_ref.at[pl.ds(first, tm), pl.ds(j * tn, tn)]
    store_mask = mine[:, None] & col_ok[None, :]

    @pl.when(t < live_ref[0])
    def _():
        g = group_ref[t]
        lead = (layer_ref[0], g) if layered else (g,)
        # fp32 must stay fp32 (Triton's default for fp32 operands is TF32).
        precision = jax.lax.Precision.DEFAULT if x_ref.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST

        def product(x, w):  # [TM, C] x [TN, C] -> [TM, TN] fp32
            return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)

        # Masks only where the static shapes need them (N a multiple of TN, K of BK: none on
        # the weight), which spares their registers.
        k_whole = k % bk == 0

        def x_piece(c):  # x's rows of this tile at columns c `[C]` (gathered: FP4 reads every other)
            ok = mine[:, None] if k_whole else mine[:, None] & (c < k)[None, :]
            return pltr.load(x_ref.at[rows[:, None], c[None, :]], mask=ok, other=0)

        def weight_piece(ref, c0, size, limit, fill, dtype):  # `[TN, size]` stored columns from c0, in dtype
            at = ref.at[lead + (pl.ds(j * tn, tn), pl.ds(c0, size))]
            if n % tn == 0 and k_whole:
                return pltr.load(at).astype(dtype)
            ok = col_ok[:, None] & (c0 + jax.lax.iota(jnp.int32, size) < limit)[None, :]
            # Filled after the cast: Triton's masked load takes no e4m3 fill value.
            return jnp.where(ok, pltr.load(at, mask=ok).astype(dtype), jnp.asarray(fill, dtype))

        def step(kb, acc):
            if fmt == "fp4":
                nb, per = bk // 2, bk // FP4_GROUP  # code bytes and scales of a piece
                codes = weight_piece(v_ref, kb * nb, nb, k // 2, 0, jnp.int32)
                # A masked scale reads as 1 (byte 127); its codes are masked to 0 already.
                s = _e8m0(weight_piece(s_ref, kb * per, per, s_ref.shape[-1], 127, jnp.int32))
                scale = jnp.broadcast_to(s[:, :, None], (tn, per, nb // per)).reshape(tn, nb)
                lo = (_e2m1(codes & 15) * scale).astype(x_ref.dtype)
                hi = (_e2m1(codes >> 4) * scale).astype(x_ref.dtype)
                # Interleaved in registers (Triton's join): byte c's nibbles are columns 2c, 2c + 1.
                w = jnp.stack([lo, hi], axis=-1).reshape(tn, bk)
                return acc + product(x_piece(kb * bk + jax.lax.iota(jnp.int32, bk)), w)
            w = weight_piece(v_ref, kb * bk, bk, k, 0, jnp.float32 if fmt == "fp8" else x_ref.dtype)
            if fmt == "fp8":  # the piece lies in one 128-column block: a scale per 128 rows
                kblock = (kb * bk) // FP8_BLOCK
                if tn <= FP8_BLOCK:  # and in one 128-row block: one scale
                    sc = s_ref[lead + ((j * tn) // FP8_BLOCK, kblock)]
                else:  # each row's block's scale (a masked row's weight is zero already)
                    blocks = jnp.minimum(cols // FP8_BLOCK, s_ref.shape[-2] - 1)
                    sc = pltr.load(s_ref.at[lead + (blocks, kblock)])[:, None]
                w = (w * sc).astype(x_ref.dtype)
            return acc + product(x_piece(kb * bk + jax.lax.iota(jnp.int32, bk)), w)

        acc = jax.lax.fori_loop(0, pl.cdiv(k, bk), step, jnp.zeros((tm, tn), jnp.float32))
        pltr.store(out_at, acc.astype(o_ref.dtype), mask=store_mask)

    @pl.when((t >= live_ref[0]) & (t < live_ref[1]))
    def _():
        pltr.store(out_at, jnp.zeros((tm, tn), o_ref.dtype), mask=store_mask)


def stored_bytes_per_expert(n: int, k: int, fmt: str | None, values_itemsize: int) -> int:
    """One expert's stored bytes: values and scales."""
    if fmt == "fp4":
        return n * (k // 2) + n * pl.cdiv(k, FP4_GROUP)
    if fmt == "fp8":
        return n * k + 4 * pl.cdiv(n, FP8_BLOCK) * pl.cdiv(k, FP8_BLOCK)
    return n * k * values_itemsize


def cost_estimate(m: int, n: int, k: int, e: int, fmt: str | None, x_itemsize: int,
                  values_itemsize: int) -> pl.CostEstimate:
    """The declared cost: HBM bytes, a static upper bound. Programs launch column tile fastest,
    so the column tiles of one step read its x rows together (L2 serves all but the first), and
    a group's consecutive steps read its expert's weight together: when one expert's stored
    bytes fit in a quarter of L2 (`L2_BYTES`), its weight comes from HBM once per group, at
    most min(E, M) groups; else once per computing step (at most ceil(M / TM) + min(E, M) - 1,
    `max_steps` less the zeroing part). x once; the output once. Flops: TM rows on every
    computing step."""
    tl = tiles(m, e, fmt)
    steps = max_steps(m, e, tl.tm) - 1
    per_expert = stored_bytes_per_expert(n, k, fmt, values_itemsize)
    reads = min(e, m) if 4 * per_expert <= L2_BYTES else steps
    return pl.CostEstimate(flops=2 * steps * tl.tm * n * k, transcendentals=0,
                           bytes_accessed=reads * per_expert + m * k * x_itemsize + m * n * x_itemsize)


def grouped_matmul_gpu(x, values, group_sizes, *, fmt: str | None = None, scale=None, layer=None,
                       interpret: bool = False):
    """Same contract as `grouped_matmul_tpu`: x `[M, K]` (bf16 or fp32, rows sorted by group)
    times each group's expert transposed: `[M, N]` in x's dtype, rows past sum(group_sizes) zero.

    values: plain `[E, N, K]` (fmt None), FP8 e4m3 `[E, N, K]` with float32 `scale` `[E,
    ceil(N/128), ceil(K/128)]` ("fp8"), or FP4 uint8 `[E, N, K/2]` with uint8 `scale` `[E, N,
    ceil(K/32)]` ("fp4"); with `layer` (int32 scalar, may be traced) both have a leading layer
    axis `[L, ...]`. group_sizes int32 `[E]`, sum <= M (not checked; rows past M are never
    touched). interpret: run in the Pallas interpreter (CPU)."""
    layered = layer is not None
    m, k, e, n, _ = operand_shapes("grouped_matmul_gpu", x, values, fmt, layered)
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    tl = tiles(m, e, fmt)
    steps = max_steps(m, e, tl.tm)
    meta = _metadata(group_sizes, m, tl.tm, steps)
    operands = [x, values] + ([scale] if fmt is not None else [])
    kernel = functools.partial(dsv4_grouped_matmul_gpu, fmt=fmt, k=k, tiles=tl, layered=layered)
    cost = cost_estimate(m, n, k, e, fmt, x.dtype.itemsize, values.dtype.itemsize)
    with declared_cost_scope(cost):
        return pl.pallas_call(
            kernel,
            grid=(pl.cdiv(n, tl.tn), steps),
            out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
            compiler_params=pltr.CompilerParams(num_warps=tl.num_warps, num_stages=NUM_STAGES),
            cost_estimate=cost,
            interpret=interpret,
            name=NAME,
        )(*meta, layer_operand(layer), *operands)
