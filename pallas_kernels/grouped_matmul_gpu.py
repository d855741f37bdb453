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

Two more forms of the same program (`_program`, `_products`):
* `grouped_swiglu_gpu`, the routed experts' first half: each step multiplies its x piece by
  both w1's and w3's tiles (x loaded once for the two), rounds the two products to x's dtype as
  the grouped matmul returns them, and stores `swiglu(h1, h3) * hw` (the rows' fp32 routing
  weights): against two calls and XLA's activation, neither product goes through HBM and x is
  read once (a 512-token chunk's exchange round on one of 8 GPUs: 6144 x 4096 bf16 x, 50 MB,
  once instead of twice; one 6144 x 2048 output written instead of two, read back, and the
  activation written). Tiles: `tiles`' TM, TN halved from 128 (two accumulators in the
  registers of one), and at TM 128 pieces of 32 values (`swiglu_tiles`).
* `block_diagonal_matmul_gpu`: x `[M, E*K]` and E blocks of M rows each, block g's rows read
  in place at x's columns g K.. and written at the output's columns g N.. (the attention's
  grouped output projection, whose groups are column blocks of its input); with x_rope, x's
  heads rotated back as they are loaded (`_rope_piece`, `rope_fused`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from ._dispatch import declared_cost_scope, layer_operand
from .grouped_matmul_ref import swiglu
from .grouped_matmul_tpu import _e2m1, _e8m0, operand_shapes  # the bit-exact decodes (plain jnp), the shape checks
from .numerics import rotate_row_heads
from .quantized_matmul_gpu import L2_BYTES

NAME = "dsv4_grouped_matmul_gpu"
SWIGLU_NAME = "dsv4_grouped_swiglu_gpu"
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


def _program(start_ref, end_ref, group_ref, live_ref, o_ref, tiles: Tiles, compute, *, m: int, n: int,
             rows_per_group: int | None):
    """The program of (column tile j, step t) over M grouped rows and N outputs a group: on a
    computing step `compute(group, j, rows, x_at, mine, cols, col_ok)` gives the `[TM, TN]` tile
    it stores (rows `[TM]` of the grouped rows, mine: those of the step's group; x_at: where
    they are in x, (its rows `[TM]`, its first column); cols `[TN]` of the group's outputs,
    col_ok: those within N); a zeroing step stores zeros. rows_per_group R (block-diagonal):
    grouped row g R + r is x's row r at columns from g K, and the output's row r at columns
    from g N."""
    tm, tn = tiles.tm, tiles.tn
    j, t = pl.program_id(0), pl.program_id(1)
    cols = j * tn + jax.lax.iota(jnp.int32, tn)
    col_ok = cols < n
    first, g = start_ref[t], group_ref[t]
    rows = first + jax.lax.iota(jnp.int32, tm)
    mine = (rows < end_ref[t]) & (rows < m)
    if rows_per_group is None:
        out_at, x_at = o_ref.at[pl.ds(first, tm), pl.ds(j * tn, tn)], (rows, 0)
    else:
        shift = g * rows_per_group
        out_at, x_at = o_ref.at[pl.ds(first - shift, tm), pl.ds(g * n + j * tn, tn)], (rows - shift, None)
    store_mask = mine[:, None] & col_ok[None, :]

    @pl.when(t < live_ref[0])
    def _():
        pltr.store(out_at, compute(g, j, rows, x_at, mine, cols, col_ok).astype(o_ref.dtype), mask=store_mask)

    @pl.when((t >= live_ref[0]) & (t < live_ref[1]))
    def _():
        pltr.store(out_at, jnp.zeros((tm, tn), o_ref.dtype), mask=store_mask)


def _rope_piece(x_ref, rows, c0, mine, cos_ref, sin_ref):
    """x_ref's rows `[TM]` (mine: those loaded) at the RoPE dims of one head, columns c0 ..
    c0 + r - 1 in pairs (2i, 2i + 1), rotated back at each row's angle (cos_ref, sin_ref fp32
    `[rows, r/2]`): `[TM, r]` in x's dtype, in fp32 as `apply_rope(..., inverse=True)` computes
    it and rounded once. A pair's members are loaded apart and interleaved back in registers
    (Triton's join)."""
    half = cos_ref.shape[-1]
    pair = jax.lax.iota(jnp.int32, half)
    ok = mine[:, None]

    def load(ref, cols):
        return pltr.load(ref.at[rows[:, None], cols[None, :]], mask=ok, other=0).astype(jnp.float32)

    re, im = load(x_ref, c0 + 2 * pair), load(x_ref, c0 + 2 * pair + 1)
    cos, sin = load(cos_ref, pair), -load(sin_ref, pair)  # the inverse: the conjugate
    rotated = jnp.stack([re * cos - im * sin, im * cos + re * sin], axis=-1)
    return rotated.reshape(rows.shape[0], 2 * half).astype(x_ref.dtype)


def _products(x_ref, weights, lead, j, x_at, mine, cols, col_ok, *, fmt: str | None, k: int, n: int, tiles: Tiles,
              x_rope=None):
    """x's rows of this tile, x_at = (their rows in x, their first column: None for the group's,
    g K), mine: those of its group, times each expert weight of `weights` ((values ref, scale ref
    or None) pairs, read at `lead` + (column tile j's columns, K)): one `[TM, TN]` fp32 product a
    weight, x's K pieces loaded once for all of them. With x_rope = (cos_ref, sin_ref, head_dim)
    (block-diagonal: x's K columns are heads of head_dim, whose last r dims are rotated), K is
    taken head by head: its NoPE dims in pieces of BK (which divides them), then its RoPE dims
    as one piece, rotated back (`_rope_piece`)."""
    tm, tn, bk = tiles.tm, tiles.tn, tiles.bk
    # fp32 must stay fp32 (Triton's default for fp32 operands is TF32).
    precision = jax.lax.Precision.DEFAULT if x_ref.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST

    def product(x, w):  # [TM, C] x [TN, C] -> [TM, TN] fp32
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    # Masks only where the static shapes need them (N a multiple of TN, K of BK: none on
    # the weight), which spares their registers.
    k_whole = k % bk == 0

    x_rows, x_col0 = x_at
    if x_col0 is None:
        x_col0 = lead[-1] * k

    def x_piece(c):  # x's rows of this tile at columns c `[C]` (gathered: FP4 reads every other)
        ok = mine[:, None] if k_whole else mine[:, None] & (c < k)[None, :]
        return pltr.load(x_ref.at[x_rows[:, None], (x_col0 + c)[None, :]], mask=ok, other=0)

    def weight_piece(ref, c0, size, limit, fill, dtype):  # `[TN, size]` stored columns from c0, in dtype
        at = ref.at[lead + (pl.ds(j * tn, tn), pl.ds(c0, size))]
        if n % tn == 0 and k_whole:
            return pltr.load(at).astype(dtype)
        ok = col_ok[:, None] & (c0 + jax.lax.iota(jnp.int32, size) < limit)[None, :]
        # Filled after the cast: Triton's masked load takes no e4m3 fill value.
        return jnp.where(ok, pltr.load(at, mask=ok).astype(dtype), jnp.asarray(fill, dtype))

    def dequantized(kb, size, v_ref, s_ref):  # the weight's `[TN, size]` piece kb (columns from kb size), in x's dtype
        if fmt == "fp4":
            nb, per = size // 2, size // FP4_GROUP  # code bytes and scales of a piece
            codes = weight_piece(v_ref, kb * nb, nb, k // 2, 0, jnp.int32)
            # A masked scale reads as 1 (byte 127); its codes are masked to 0 already.
            s = _e8m0(weight_piece(s_ref, kb * per, per, s_ref.shape[-1], 127, jnp.int32))
            scale = jnp.broadcast_to(s[:, :, None], (tn, per, nb // per)).reshape(tn, nb)
            lo = (_e2m1(codes & 15) * scale).astype(x_ref.dtype)
            hi = (_e2m1(codes >> 4) * scale).astype(x_ref.dtype)
            # Interleaved in registers (Triton's join): byte c's nibbles are columns 2c, 2c + 1.
            return jnp.stack([lo, hi], axis=-1).reshape(tn, size)
        w = weight_piece(v_ref, kb * size, size, k, 0, jnp.float32 if fmt == "fp8" else x_ref.dtype)
        if fmt == "fp8":  # the piece lies in one 128-column block: a scale per 128 rows
            kblock = (kb * size) // FP8_BLOCK
            if tn <= FP8_BLOCK:  # and in one 128-row block: one scale
                sc = s_ref[lead + ((j * tn) // FP8_BLOCK, kblock)]
            else:  # each row's block's scale (a masked row's weight is zero already)
                blocks = jnp.minimum(cols // FP8_BLOCK, s_ref.shape[-2] - 1)
                sc = pltr.load(s_ref.at[lead + (blocks, kblock)])[:, None]
            w = (w * sc).astype(x_ref.dtype)
        return w

    def piece(kb, x, accs):  # x's piece kb (its width's) times each weight's
        return tuple(acc + product(x, dequantized(kb, x.shape[1], v, sc)) for acc, (v, sc) in zip(accs, weights))

    def step(kb, accs):
        return piece(kb, x_piece(kb * bk + jax.lax.iota(jnp.int32, bk)), accs)

    zeros = tuple(jnp.zeros((tm, tn), jnp.float32) for _ in weights)
    if x_rope is None:
        return jax.lax.fori_loop(0, pl.cdiv(k, bk), step, zeros)
    cos_ref, sin_ref, head_dim = x_rope
    rope = 2 * cos_ref.shape[-1]
    nope = head_dim - rope  # BK and the RoPE dims divide it, and BK the RoPE dims (`rope_fused`)

    def head(h, accs):
        accs = jax.lax.fori_loop(h * (head_dim // bk), h * (head_dim // bk) + nope // bk, step, accs)
        x = _rope_piece(x_ref, x_rows, x_col0 + h * head_dim + nope, mine, cos_ref, sin_ref)
        return piece(h * (head_dim // rope) + nope // rope, x, accs)

    return jax.lax.fori_loop(0, k // head_dim, head, zeros)


def _weight_refs(refs, fmt: str | None, count: int):
    """The (values, scale) ref pairs of `count` weights at the head of refs, and the rest."""
    per = 1 if fmt is None else 2
    pairs = [(refs[per * i], refs[per * i + 1] if fmt is not None else None) for i in range(count)]
    return pairs, refs[per * count:]


def dsv4_grouped_matmul_gpu(start_ref, end_ref, group_ref, live_ref, layer_ref, x_ref, *refs,
                            fmt: str | None, m: int, n: int, k: int, tiles: Tiles, layered: bool,
                            rows_per_group: int | None, head_dim: int | None = None):
    """One (column tile, step) program of `grouped_matmul_gpu` (and of
    `block_diagonal_matmul_gpu`: rows_per_group, `_program`; with head_dim, refs start with the
    rows' cos and sin, `_rope_piece`); Triton names the kernel after this function."""
    x_rope = None
    if head_dim is not None:
        x_rope, refs = (*refs[:2], head_dim), refs[2:]
    weights, (o_ref,) = _weight_refs(refs, fmt, 1)

    def compute(g, j, rows, x_at, mine, cols, col_ok):
        lead = (layer_ref[0], g) if layered else (g,)
        (acc,) = _products(x_ref, weights, lead, j, x_at, mine, cols, col_ok, fmt=fmt, k=k, n=n, tiles=tiles,
                           x_rope=x_rope)
        return acc

    _program(start_ref, end_ref, group_ref, live_ref, o_ref, tiles, compute, m=m, n=n, rows_per_group=rows_per_group)


def dsv4_grouped_swiglu_gpu(start_ref, end_ref, group_ref, live_ref, layer_ref, x_ref, hw_ref, *refs,
                            fmt: str | None, m: int, n: int, k: int, tiles: Tiles, layered: bool,
                            rows_per_group: int | None, limit: float):
    """One (column tile, step) program of `grouped_swiglu_gpu`: both products of a tile, each
    rounded to x's dtype as `grouped_matmul` rounds it, their `swiglu` times the rows' routing
    weights hw, in fp32; Triton names the kernel after this function."""
    weights, (o_ref,) = _weight_refs(refs, fmt, 2)

    def compute(g, j, rows, x_at, mine, cols, col_ok):
        lead = (layer_ref[0], g) if layered else (g,)
        h1, h3 = (h.astype(x_ref.dtype) for h in _products(x_ref, weights, lead, j, x_at, mine, cols, col_ok,
                                                           fmt=fmt, k=k, n=n, tiles=tiles))
        hw = pltr.load(hw_ref.at[rows], mask=mine, other=0)
        return swiglu(h1, h3, limit) * hw[:, None]

    _program(start_ref, end_ref, group_ref, live_ref, o_ref, tiles, compute, m=m, n=n, rows_per_group=rows_per_group)


def stored_bytes_per_expert(n: int, k: int, fmt: str | None, values_itemsize: int) -> int:
    """One expert's stored bytes: values and scales."""
    if fmt == "fp4":
        return n * (k // 2) + n * pl.cdiv(k, FP4_GROUP)
    if fmt == "fp8":
        return n * k + 4 * pl.cdiv(n, FP8_BLOCK) * pl.cdiv(k, FP8_BLOCK)
    return n * k * values_itemsize


def cost_estimate(m: int, n: int, k: int, e: int, fmt: str | None, x_itemsize: int,
                  values_itemsize: int, weights: int = 1) -> pl.CostEstimate:
    """The declared cost: HBM bytes, a static upper bound. Programs launch column tile fastest,
    so the column tiles of one step read its x rows together (L2 serves all but the first), and
    a group's consecutive steps read its expert's weight together: when one expert's stored
    bytes fit in a quarter of L2 (`L2_BYTES`), its weight comes from HBM once per group, at
    most min(E, M) groups; else once per computing step (at most ceil(M / TM) + min(E, M) - 1,
    `max_steps` less the zeroing part). x once; the output once. Flops: TM rows on every
    computing step. `weights`: the expert weights a step multiplies x by (2: `grouped_swiglu_gpu`,
    which also reads the rows' fp32 routing weights)."""
    tl = tiles(m, e, fmt)
    steps = max_steps(m, e, tl.tm) - 1
    per_expert = stored_bytes_per_expert(n, k, fmt, values_itemsize)
    reads = min(e, m) if 4 * per_expert <= L2_BYTES else steps
    routing = 4 * m if weights == 2 else 0
    return pl.CostEstimate(flops=2 * weights * steps * tl.tm * n * k, transcendentals=m * n if weights == 2 else 0,
                           bytes_accessed=weights * reads * per_expert + m * k * x_itemsize + m * n * x_itemsize
                           + routing)


def _call(kernel, name: str, x, weights, group_sizes, extra, *, fmt: str | None, layer, tile_choice,
          interpret: bool, rows_per_group: int | None = None, extra_bytes: int = 0, **params):
    """The pallas_call of `kernel` over x `[M, K]` sorted by group and the expert weights
    `weights` ((values, scale) pairs, each `[E, N, K]`-shaped as stored, or `[L, E, ...]` with
    `layer`), `extra` operands after x (extra_bytes: what they add to `cost_estimate`'s bytes),
    tiles `tile_choice(M, E, fmt)`: `[M, N]` in x's dtype. rows_per_group R: block-diagonal, x
    `[R, E*K]` -> `[R, E*N]` (`block_diagonal_matmul_gpu`)."""
    layered = layer is not None
    grouped = x if rows_per_group is None else jax.ShapeDtypeStruct(
        (x.shape[0] * weights[0][0].shape[-3], x.shape[1] // weights[0][0].shape[-3]), x.dtype)
    m, k, e, n, _ = operand_shapes(name, grouped, weights[0][0], fmt, layered)
    out_shape = (m, n) if rows_per_group is None else (rows_per_group, e * n)
    if m == 0:
        return jnp.zeros(out_shape, x.dtype)
    tl = tile_choice(m, e, fmt)
    steps = max_steps(m, e, tl.tm)
    meta = _metadata(group_sizes, m, tl.tm, steps)
    operands = [a for v, sc in weights for a in ([v] + ([sc] if fmt is not None else []))]
    body = functools.partial(kernel, fmt=fmt, m=m, n=n, k=k, tiles=tl, layered=layered, rows_per_group=rows_per_group,
                             **params)
    cost = cost_estimate(m, n, k, e, fmt, x.dtype.itemsize, weights[0][0].dtype.itemsize, len(weights))
    cost = pl.CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                           bytes_accessed=cost.bytes_accessed + extra_bytes)
    with declared_cost_scope(cost):
        return pl.pallas_call(
            body,
            grid=(pl.cdiv(n, tl.tn), steps),
            out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype),
            compiler_params=pltr.CompilerParams(num_warps=tl.num_warps, num_stages=NUM_STAGES),
            cost_estimate=cost,
            interpret=interpret,
            name=name,
        )(*meta, layer_operand(layer), x, *extra, *operands)


def grouped_matmul_gpu(x, values, group_sizes, *, fmt: str | None = None, scale=None, layer=None,
                       interpret: bool = False):
    """Same contract as `grouped_matmul_tpu`: x `[M, K]` (bf16 or fp32, rows sorted by group)
    times each group's expert transposed: `[M, N]` in x's dtype, rows past sum(group_sizes) zero.

    values: plain `[E, N, K]` (fmt None), FP8 e4m3 `[E, N, K]` with float32 `scale` `[E,
    ceil(N/128), ceil(K/128)]` ("fp8"), or FP4 uint8 `[E, N, K/2]` with uint8 `scale` `[E, N,
    ceil(K/32)]` ("fp4"); with `layer` (int32 scalar, may be traced) both have a leading layer
    axis `[L, ...]`. group_sizes int32 `[E]`, sum <= M (not checked; rows past M are never
    touched). interpret: run in the Pallas interpreter (CPU)."""
    return _call(dsv4_grouped_matmul_gpu, NAME, x, [(values, scale)], group_sizes, [], fmt=fmt, layer=layer,
                 tile_choice=tiles, interpret=interpret)


def block_diagonal_matmul_gpu(x, values, *, fmt: str | None = None, scale=None, layer=None, x_rope=None,
                              head_dim: int | None = None, interpret: bool = False):
    """x `[M, E*K]` times the block-diagonal weight whose E blocks values `[E, N, K]` holds (as
    `grouped_matmul_gpu` takes them; `[L, E, ...]` with `layer`): `[M, E*N]`, x's columns
    g K .. (g + 1) K - 1 times block g transposed into columns g N .. (g + 1) N - 1. The grouped
    matmul of E groups of M rows, group g's rows read in place in x's column block g and
    written into the output's (no re-layout of x into groups of rows, nor back). With x_rope =
    (cos, sin) fp32 `[M, r/2]`: x's columns are heads of head_dim whose last r dims are rotated
    at each row's angle, rotated back as they are loaded (`_rope_piece`) where the heads allow
    (`rope_fused`), else by XLA first."""
    e = values.shape[-3] if values.ndim >= 3 else 1
    if x.ndim != 2 or x.shape[1] % e:
        raise ValueError(f"block_diagonal_matmul_gpu: x {tuple(x.shape)} must be [M, E*K] for {e} blocks")
    extra, params, tile_choice = [], {}, tiles
    if x_rope is not None:
        half = x_rope[0].shape[-1]
        if head_dim is None or head_dim % 2 or 2 * half > head_dim or (x.shape[1] // e) % head_dim:
            raise ValueError(f"block_diagonal_matmul_gpu: x {tuple(x.shape)} is not heads of head_dim {head_dim} "
                             f"with {2 * half} RoPE dims")
        bk = rope_fused(head_dim, half, fmt)
        if bk is None:
            x = rotate_row_heads(x, x_rope, head_dim, inverse=True)
        else:
            extra = [a.astype(jnp.float32) for a in x_rope]
            params = dict(head_dim=head_dim, extra_bytes=sum(a.size * 4 for a in extra))
            tile_choice = functools.partial(rope_tiles, bk=bk)
    return _call(dsv4_grouped_matmul_gpu, NAME, x, [(values, scale)], jnp.full((e,), x.shape[0], jnp.int32), extra,
                 fmt=fmt, layer=layer, tile_choice=tile_choice, interpret=interpret, rows_per_group=x.shape[0],
                 **params)


def rope_tiles(m: int, e: int, fmt: str | None, bk: int) -> Tiles:
    """`block_diagonal_matmul_gpu`'s tiles when it rotates x's heads back: `tiles`' with K
    pieces of bk (`rope_fused`), and at the large tiles TN 128, which leaves the registers for
    the RoPE piece's two members, cos and sin (ptxas, sm_90a: TN 256 spills)."""
    tl = tiles(m, e, fmt)._replace(bk=bk)
    return tl._replace(tn=128) if tl.tm == LARGE.tm else tl


def rope_fused(head_dim: int, half: int, fmt: str | None) -> int | None:
    """The K piece (BK) with which `block_diagonal_matmul_gpu` rotates x's heads back as it
    loads them: one that divides a head's NoPE dims and its r RoPE dims (64: Flash's and Pro's
    448 and 64, the large tiles' BK), r a power of two from 16 (one tensor-core piece, r/2 lanes
    a member) that divides the NoPE dims (the pieces are whole multiples of their width), plain
    weights or FP8 ones (the RoPE dims then within one 128-column scale block); None where it
    cannot."""
    nope, rope = head_dim - 2 * half, 2 * half
    if fmt == "fp4" or rope < 16 or rope & (rope - 1) or nope % rope or (
            fmt == "fp8" and nope % FP8_BLOCK + rope > FP8_BLOCK):
        return None
    return next((bk for bk in (64, 32, 16) if nope % bk == 0 and rope % bk == 0), None)


def swiglu_tiles(m: int, e: int, fmt: str | None = None) -> Tiles:
    """`grouped_swiglu_gpu`'s tiles: `tiles`' TM (so the same steps), with TN halved from 128
    on, which keeps its two fp32 accumulators in the registers one takes at `tiles`, and at the
    large tiles K pieces of 32 values (`LARGE_FP8_BK`) for its two dequantized pieces (ptxas,
    sm_90a: FP4 at 64 spills)."""
    tl = tiles(m, e, fmt)
    if tl.tm == LARGE.tm:
        return tl._replace(tn=tl.tn // 2, bk=LARGE_FP8_BK)
    return tl._replace(tn=tl.tn // 2) if tl.tn > 64 else tl


def grouped_swiglu_gpu(x, w1, w3, group_sizes, hw, *, fmt: str | None = None, limit: float, layer=None,
                       interpret: bool = False):
    """The routed experts' first half, fused: `swiglu(x w1_g^T, x w3_g^T, limit) * hw` for the
    rows of each group g, each product rounded to x's dtype first (as `grouped_matmul` returns
    it), the rest in fp32, the result rounded to x's dtype: `[M, N]`, rows past
    sum(group_sizes) zero (their hw is not read). w1, w3: (values, scale) as
    `grouped_matmul_gpu` takes them, alike in format and shape; hw fp32 `[M]`, the rows' routing
    weights. Neither product goes through HBM: against two `grouped_matmul_gpu` calls and
    XLA's activation, x is read once and one `[M, N]` array written instead of five moved."""
    if w1[0].shape != w3[0].shape or hw.shape != x.shape[:1]:
        raise ValueError(f"grouped_swiglu_gpu: w1 {tuple(w1[0].shape)} and w3 {tuple(w3[0].shape)} must match, "
                         f"hw {tuple(hw.shape)} must be [M] for x {tuple(x.shape)}")
    return _call(dsv4_grouped_swiglu_gpu, SWIGLU_NAME, x, [w1, w3], group_sizes, [hw.astype(jnp.float32)], fmt=fmt,
                 layer=layer, tile_choice=swiglu_tiles, interpret=interpret, limit=limit)
