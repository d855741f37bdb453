"""Rows grouped by expert times each group's expert weight: the Mosaic TPU kernel (also run by
the Pallas interpreter on CPU), in the manner of a megablox grouped matmul; its forms for the
routed experts' first half (`grouped_swiglu_tpu`: two weights and their activation), for a
block-diagonal weight (`block_diagonal_matmul_tpu`), and for rows in pieces (x `[M, P, K/P]`,
the output `[M, P, N/P]`: the ragged exchange's layout on TPU, `grouped_matmul_tpu`).

x `[M, K]` holds the rows sorted by expert (group g's rows contiguous, groups in order), and
`group_sizes` `[E]` says how many rows each expert has. The weights stay as stored
(`dsv4_jax/model/quantized.py`): a plain `[E, N, K]` stack, FP8 (e4m3 values `[E, N, K]`, float32
scales `[E, ceil(N/128), ceil(K/128)]`) or FP4 (uint8 values `[E, N, K/2]`, two e2m1 codes a
byte, and E8M0 scale bytes `[E, N, ceil(K/32)]`); optionally the stack of every layer `[L, E,
...]`, indexed by a traced layer number inside the index maps (a layer sliced out would be
copied whole first).

Grid `(N / TN, steps)`, the step axis innermost. `steps` is a static bound: the M / TM row tiles
plus one extra visit for each group that starts inside a tile (a tile that straddles g groups is
visited g times, once for each), at most `M / TM + min(E, M) - 1`. Metadata computed outside the
kernel (`_metadata`) and scalar-prefetched into SMEM maps each step to its group and row tile;
groups of size 0 get no step, so no value of an unchosen expert is read (when no group has a
row at all, the first step's block, of the last expert, is still fetched). A group's consecutive
steps keep its weight block index, so the pipeline fetches the block once, and the steps past
the last live one repeat the previous indices, so they fetch nothing. Each step's block is the
expert's `[TN, K]` column tile (K whole): every chosen expert's values are read once per call.

On the first step of a group, the weight tile is dequantized into a VMEM scratch exactly as
`QuantizedWeight.dequantize` does it (value times scale in float32, rounded once to x's dtype)
and kept for the group's further row tiles. Every step multiplies its `[TM, K]` row tile with fp32
accumulation and writes only its group's rows (a tile that straddles groups is written by each
of them in turn; rows no group owns, past sum(group_sizes), are written as zeros).

Scales are read in the orientation XLA's default TPU layout stores them, so that handing them to
the kernel (whose operands must be row-major) is a bitcast, not a copy of the stack: an array
whose minor dim is under 128 is laid out by XLA with its largest dim minor (libtpu 0.0.42.1, on
v5p, v6e and v7x: f32 `[256, 16, 32]` as `[16, 32, 256]`, u8 `[256, 4096, 64]` as `[256, 64,
4096]`, the same with a leading layer axis). FP8 scales `[E, N/128, K/128]` are therefore
taken as `[N/128, K/128, E]` (the whole layer's, a few hundred KiB, read once per call) and FP4
scales `[E, N, K/32]` as `[E, K/32, N]` when K/32 is not a multiple of 128. Other shapes work
too; XLA then copies the scales first.

FP4: per 128-byte chunk of codes, the 8 scales are spread over the bytes (16 each) and the low
and high nibbles' values interleaved back into x's column order by in-vreg lane gathers
(`take_along_axis`, Mosaic's dynamic_gather), so x is used as it is.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._dispatch import layer_operand
from .grouped_matmul_ref import swiglu
from .sparse_attention_tpu import rotated_lanes

NAME = "dsv4_grouped_matmul"  # the kernels' names in the compiled programs
SWIGLU_NAME = "dsv4_grouped_swiglu"
LANES = 128  # the lane width, and the FP8 scale block
FP4_BYTES = 16  # code bytes per FP4 scale (32 elements)
ROWS = 16  # a tile of bf16 rows
MAX_TM = 512
MAX_TN = 512
WIDE_MIN_TM = 128  # a prefill's row tile does not shrink below the MXU's side to widen TN
# What the tiles may take of VMEM (double-buffered blocks, the dequantized tile, the product),
# and the scoped limit given to Mosaic (under v5p's and v7x's 64 MiB).
VMEM_BUDGET = 32 << 20
VMEM_LIMIT = 48 << 20


def _round(a: int, b: int) -> int:
    return pl.cdiv(a, b) * b


def x_columns(k: int, fmt: str | None) -> int:
    """The columns of the wrapper's x (and of the dequantized tile): K up to whole lanes (FP4:
    twice the code bytes K/2 up to whole lanes)."""
    return 2 * _round(k // 2, LANES) if fmt == "fp4" else _round(k, LANES)


def vmem_bytes(tm: int, tn: int, n: int, k: int, e: int, fmt: str | None, x_itemsize: int,
               w_itemsize: int, weights: int = 1) -> int:
    """VMEM the tiles take: the double-buffered x, weight, scale and output blocks, the
    dequantized weight tile (quantized formats), FP4's int32 scale scratches and the fp32
    product; of each of `weights` weights (2: `grouped_swiglu_tpu`, with its routing weights'
    block, a lane wide)."""
    kx = x_columns(k, fmt)
    kv = kx // 2 if fmt == "fp4" else kx
    groups = _round(pl.cdiv(k, 2 * FP4_BYTES), LANES)
    scales = {"fp8": pl.cdiv(n, LANES) * pl.cdiv(k, LANES) * _round(e, LANES) * 4, "fp4": tn * groups}.get(fmt, 0)
    tile = tn * kx * x_itemsize if fmt else 0
    fp4_scratch = 2 * tn * groups * 4 if fmt == "fp4" else 0
    hw = tm * LANES * 4 if weights > 1 else 0
    return (2 * (tm * kx * x_itemsize + weights * (tn * kv * w_itemsize + scales) + hw + tm * tn * x_itemsize)
            + weights * (tile + tm * tn * 4) + fp4_scratch)


def tiles(m: int, n: int, k: int, e: int, fmt: str | None, x_itemsize: int, w_itemsize: int,
          weights: int = 1, whole_width: bool = False) -> tuple[int, int]:
    """(TM, TN). TM: the rows a chosen expert gets on average when every row picks another one
    (M / min(E, M)) rounded up to a power of two, at least 16 (bf16 rows come in 16s) and at
    most 512: a step multiplies TM rows whatever its group holds, and the grid has up to one
    step per group beyond the M / TM tiles, so a TM well above the group size wastes MXU work
    (decode: 1 row per expert, TM 16) and one well below adds steps. TN: the largest multiple
    of 128 up to 512 that divides N rounded up to 128; or, for more rows than one tile holds (a
    prefill chunk, whose x is read once per column tile, each expert's weight once in all), up
    to half of N: two column tiles (one for each TensorCore of a v5p megacore). Both shrink
    until `vmem_bytes` (of `weights` weights) fits VMEM_BUDGET: TN first, or for a wide x TM
    first, down to WIDE_MIN_TM. whole_width: TN is N up to whole lanes (one column tile: an
    output in pieces, `grouped_matmul_tpu`), and only TM shrinks; ValueError if no TM fits."""
    per_group = pl.cdiv(m, max(1, min(e, m)))
    tm = ROWS
    while tm < min(per_group, MAX_TM):
        tm *= 2
    blocks = pl.cdiv(n, LANES)
    wide = m > MAX_TM
    max_tn = max(MAX_TN, _round(pl.cdiv(n, 2), LANES)) if wide else MAX_TN
    candidates = [LANES * d for d in range(max_tn // LANES, 0, -1) if blocks % d == 0]
    if whole_width:
        candidates = [LANES * blocks]
    tn = candidates[0]
    while vmem_bytes(tm, tn, n, k, e, fmt, x_itemsize, w_itemsize, weights) > VMEM_BUDGET:
        smaller = [c for c in candidates if c < tn]
        if wide and tm > WIDE_MIN_TM:
            tm //= 2
        elif smaller:
            tn = smaller[0]
        elif tm > ROWS:
            tm //= 2
        else:
            raise ValueError(f"grouped_matmul: K = {k} is too wide for one [{tm}, K] x [{tn}, K] step in VMEM")
    return tm, tn


def max_steps(m_tiles: int, m: int, e: int) -> int:
    """The static grid bound along the steps: every row tile once, plus one step for each group
    after the first that starts inside a tile; at most min(E, M) groups have rows."""
    return m_tiles + max(1, min(e, m)) - 1


def operand_shapes(kernel: str, x, values, fmt: str | None, layered: bool) -> tuple[int, int, int, int, int]:
    """(M, K, E, N, the stored K) of a grouped matmul's x `[M, K]` and stored values `[E, N, K]`
    (`[L, E, ...]` when layered; FP4: K / 2 code bytes); ValueError naming `kernel` for an unknown
    format or operands that do not fit."""
    if fmt not in (None, "fp8", "fp4"):
        raise ValueError(f"{kernel}: unknown format {fmt!r}")
    *lead, n, kv = values.shape
    if len(lead) != 1 + layered:
        raise ValueError(f"{kernel}: weight {list(values.shape)} needs {'[L, E, N, K]' if layered else '[E, N, K]'}")
    m, k = x.shape
    if kv != (k // 2 if fmt == "fp4" else k) or (fmt == "fp4" and k % 2):
        raise ValueError(f"{kernel}: x {tuple(x.shape)} and a {fmt or 'plain'} weight {list(values.shape)}")
    return m, k, lead[-1], n, kv


def _metadata(group_sizes, m_tiles: int, tm: int, steps: int):
    """Per grid step (int32 `[steps]` each): its group, its output row tile and the row tile of x
    it reads; and `[E + 1]` the groups' row offsets, and `[2]` (the steps that compute a group,
    those plus the steps that zero the tiles past every group).

    Steps come in order: the groups with rows, each over its row tiles; then the row tiles past
    sum(group_sizes), zeroed; then padding up to `steps`. Zeroing and padding steps keep the last
    group's weight block (nothing is fetched for them), and x's last tile (idem); padding steps
    also keep the last output tile, so they write nothing back."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    total = ends[-1]
    first = starts // tm
    count = jnp.where(sizes > 0, (ends - 1) // tm - first + 1, 0)
    done = jnp.cumsum(count)  # steps through each group
    n_real = done[-1]
    t = jnp.arange(steps, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(done, t, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
    # Clamped: a sum past M (not allowed) must still not send a block index past the arrays.
    real_tile = jnp.minimum(first[group] + t - (done[group] - count[group]), m_tiles - 1)
    last = jnp.maximum(n_real - 1, 0)  # the last computing step (step 0 when no group has rows)
    first_zero = (total + tm - 1) // tm
    zero_tile = jnp.minimum(first_zero + t - n_real, m_tiles - 1)
    real = t < n_real
    group = jnp.where(real, group, group[last])
    out_tile = jnp.where(real, real_tile, zero_tile)
    x_tile = jnp.where(real, real_tile, jnp.where(n_real > 0, real_tile[last], 0))
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    live = jnp.stack([n_real, n_real + m_tiles - first_zero]).astype(jnp.int32)
    return group, out_tile, x_tile, offsets, live


def _fp8_dequantize(v_ref, s_ref, w_ref, group, n_tile, k_total: int):
    """The `[TN, Kp]` e4m3 tile times its 128x128 blocks' scales into w_ref in x's dtype;
    columns past K are zeroed (VMEM past an array's end holds anything, and an e4m3 NaN times
    zero is NaN). s_ref: the layer's scales `[N/128, K/128, E]`, the expert along lanes."""
    tn, kp = w_ref.shape
    rows_s, _, e = s_ref.shape
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, e), 1)

    def block_column(kb, carry):  # a loop, not unrolled: K/128 columns of TN/128 blocks
        cols = pl.ds(pl.multiple_of(kb * LANES, LANES), LANES)
        for nb in range(tn // LANES):
            rows = pl.ds(nb * LANES, LANES)
            # A block past the weight's end (the last column tile) reads the last scale row;
            # its output columns are dropped.
            s = s_ref[jnp.minimum(n_tile * (tn // LANES) + nb, rows_s - 1), pl.ds(kb, 1), :]  # [1, E]
            # The group's scale: one lane kept, summed with zeros (exact).
            scale = jnp.sum(jnp.where(lane == group, s, jnp.zeros_like(s)), axis=1, keepdims=True)
            w = (v_ref[rows, cols].astype(jnp.float32) * scale).astype(w_ref.dtype)
            if k_total % LANES:
                w = jnp.where(jax.lax.broadcasted_iota(jnp.int32, w.shape, 1) < k_total - kb * LANES, w,
                              jnp.zeros_like(w))
            w_ref[rows, cols] = w
        return carry

    jax.lax.fori_loop(0, kp // LANES, block_column, 0)


def _e2m1(c):
    """e2m1 codes (int32, low 4 bits) -> float32: sign bit 3, exponent bits 1-2, mantissa bit 0;
    magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. A code with exponent e > 0 is 2^(e-1) (1 + m/2),
    whose float32 bits are the code's low 3 bits shifted to the top of the mantissa plus the
    bits of 0.5; e = 0 gives 0 or 0.5."""
    c7 = c & 7
    half = 0x3F000000  # 0.5
    mag = jnp.where(c7 >= 2, (c7 << 22) + half, c7 * half)
    return jax.lax.bitcast_convert_type(mag | ((c & 8) << 28), jnp.float32)


def _e8m0(b):
    """E8M0 exponent bytes (int32) -> float32 2^(b-127), as `e8m0_to_float32` (b = 0: 2^-127,
    a subnormal; b = 255: NaN)."""
    bits = jnp.where(b == 0, 0x00400000, jnp.where(b == 255, 0x7FC00000, b << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _fp4_dequantize(v_ref, s_ref, w_ref, b_ref, t_ref):
    """The `[TN, K2p]` code bytes into w_ref `[TN, 2 K2p]` in x's dtype, in x's column order
    (byte j's low nibble is element 2j, its high nibble 2j + 1), each code times its E8M0 scale.

    s_ref: the scale bytes `[TN, G]` (G a multiple of 128), or `[G, TN]` with t_ref, an int32
    `[Gp, TN]` scratch (G rounded up to 128) where they are padded with zeros before being
    transposed; either way they land in b_ref, int32 `[TN, Gp]`. Then, per 128-byte chunk of
    codes, in-vreg lane gathers spread its 8 scales (from one 128-lane column of b_ref) over
    16 bytes each, and interleave its low and high values into the chunk's 256 output columns.
    Bytes past K/2 (VMEM past the array's end) decode to finite values, which x's zero columns
    cancel."""
    tn, kx = w_ref.shape
    if t_ref is None:
        b_ref[...] = s_ref[...].astype(jnp.int32)
    else:
        t_ref[...] = jnp.zeros_like(t_ref)
        t_ref[pl.ds(0, s_ref.shape[0]), :] = s_ref[...].astype(jnp.int32)
        b_ref[...] = t_ref[...].T
    per_chunk = LANES // FP4_BYTES  # the scales of a 128-byte chunk
    per_column = LANES // per_chunk  # the chunks one 128-lane column of scales serves
    lane = jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 1)
    spread = jax.lax.div(lane, FP4_BYTES)  # byte lane -> scale lane
    low_nibble = (lane & 1) == 0  # output lane 2j + p takes byte j's nibble p

    def chunk(c, carry):  # a loop, not unrolled: the body is large and K/256 chunks many
        scale_cols = pl.ds(pl.multiple_of(jax.lax.div(c, per_column) * LANES, LANES), LANES)
        idx = spread + jax.lax.rem(c, per_column) * per_chunk
        for r in range(tn // LANES):
            rows = pl.ds(r * LANES, LANES)
            scale = _e8m0(jnp.take_along_axis(b_ref[rows, scale_cols], idx, axis=1, mode="promise_in_bounds"))
            codes = v_ref[rows, pl.ds(pl.multiple_of(c * LANES, LANES), LANES)].astype(jnp.int32)
            lo, hi = _e2m1(codes & 15) * scale, _e2m1(codes >> 4) * scale
            for half in range(2):  # output columns 256c + 128 half + l take byte 64 half + l // 2
                pick = jax.lax.shift_right_logical(lane, 1) + half * (LANES // 2)
                w = jnp.where(low_nibble, jnp.take_along_axis(lo, pick, axis=1, mode="promise_in_bounds"),
                              jnp.take_along_axis(hi, pick, axis=1, mode="promise_in_bounds"))
                w_ref[rows, pl.ds(pl.multiple_of((2 * c + half) * LANES, LANES), LANES)] = w.astype(w_ref.dtype)
        return carry

    jax.lax.fori_loop(0, kx // (2 * LANES), chunk, 0)


def _heads_rotated(x, cos_ref, sin_ref, head_dim: int):
    """x `[TM, K]`, heads of head_dim columns whose last W lanes hold their RoPE dims, with
    those lanes rotated by the rows' rope lanes cos_ref / sin_ref fp32 `[TM, W]` (1 and 0 on
    NoPE lanes; sin signed for the pair member, `rotated_lanes`), in fp32, rounded to x's dtype
    as `apply_rope` rounds. W and head_dim are whole lanes: every slice is lane-aligned."""
    w = cos_ref.shape[-1]
    cos, sin = cos_ref[...][None], sin_ref[...][None]
    pieces = []
    for end in range(head_dim, x.shape[1] + 1, head_dim):
        if head_dim > w:
            pieces.append(x[:, end - head_dim:end - w])
        pieces.append(rotated_lanes(x[None, :, end - w:end].astype(jnp.float32), cos, sin)[0].astype(x.dtype))
    return jnp.concatenate(pieces, axis=1)


def _kernel(group_ref, tile_ref, x_tile_ref, offsets_ref, live_ref, layer_ref, x_ref, *refs, fmt: str | None,
            k_total: int, scales_transposed: bool, head_dim: int | None, weights: int, limit: float | None):
    del x_tile_ref, layer_ref  # used by the index maps only
    lanes, refs = (refs[:2], refs[2:]) if head_dim else (None, refs)
    per = 1 if fmt is None else 2  # a weight's operands: its values, and its scales
    stored, refs = [refs[i * per:(i + 1) * per] for i in range(weights)], refs[weights * per:]
    hw_ref, refs = (refs[0], refs[1:]) if limit is not None else (None, refs)
    o_ref, refs = refs[0], refs[1:]
    w_tiles, refs = (refs[:weights], refs[weights:]) if fmt is not None else ((), refs)
    b_ref, t_ref = (refs[0], refs[1] if scales_transposed else None) if fmt == "fp4" else (None, None)
    n_tile, t = pl.program_id(0), pl.program_id(1)
    group, tile = group_ref[t], tile_ref[t]
    prev = jnp.maximum(t - 1, 0)
    computes = t < live_ref[0]
    new_group = (t == 0) | (group_ref[prev] != group)
    new_tile = (t == 0) | (tile_ref[prev] != tile)
    tm, tn = o_ref.shape[0], math.prod(o_ref.shape[1:])  # (an output in pieces: its rows whole)

    if fmt is not None:
        @pl.when(computes & new_group)
        def _():
            for (v_ref, s_ref), w_ref in zip(stored, w_tiles):
                if fmt == "fp8":
                    _fp8_dequantize(v_ref, s_ref, w_ref, group, n_tile, k_total)
                else:
                    _fp4_dequantize(v_ref, s_ref, w_ref, b_ref, t_ref)

    @pl.when(computes)
    def _():
        x = x_ref[...].reshape(tm, -1)  # (rows in pieces: whole rows)
        if lanes is not None:
            x = _heads_rotated(x, *lanes, head_dim)

        def product(i):  # x times weight i's tile, rounded to x's dtype as the grouped matmul gives it
            if fmt is not None:
                w = w_tiles[i][...]
            else:
                w = stored[i][0][...].astype(x.dtype)
                if k_total % LANES:  # see _fp8_dequantize: past K, VMEM holds anything
                    w = jnp.where(jax.lax.broadcasted_iota(jnp.int32, w.shape, 1) < k_total, w, jnp.zeros_like(w))
            # Stated, not left to jax_default_matmul_precision: Mosaic rejects a bf16 product at
            # fp32 precision, and an fp32 one must stay fp32.
            precision = jax.lax.Precision.DEFAULT if x.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST
            return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32).astype(o_ref.dtype)

        y = product(0)
        if limit is not None:  # the routed experts' first half: the activation times the routing weights
            y = (swiglu(y, product(1), limit) * hw_ref[...]).astype(o_ref.dtype)
        row = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (row >= offsets_ref[group]) & (row < offsets_ref[group + 1])
        # A tile's first visit starts from zeros (the buffer holds the previous tile's output);
        # a later visit by the next group keeps what the earlier groups wrote.
        before = jnp.where(new_tile, jnp.zeros_like(y), o_ref[...].reshape(tm, tn))
        o_ref[...] = jnp.where(mine, y, before).reshape(o_ref.shape)

    @pl.when((t >= live_ref[0]) & (t < live_ref[1]))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)


def _check_block(tm: int, tn: int) -> None:
    if tm % ROWS or tn % LANES:
        raise ValueError(f"TM must be a multiple of {ROWS} and TN of {LANES}, got {tm}, {tn}")


def in_pieces(width: int, pieces: int, fmt: str | None = None) -> bool:
    """Whether rows of `width` values kept in `pieces` pieces `[pieces, width / pieces]` (see
    `grouped_matmul_tpu`) are read or written as they are: more than one piece, each of whole
    lanes, and (as x) no columns to add for the format."""
    return pieces > 1 and width % (pieces * LANES) == 0 and x_columns(width, fmt) == width


def output_tiles(m: int, n: int, k: int, e: int, fmt: str | None, x_itemsize: int, w_itemsize: int,
                 out_pieces: int) -> tuple[int, int, bool]:
    """(TM, TN, whether the kernel writes the output in its pieces) of `grouped_matmul_tpu`: for
    an output in pieces that `in_pieces` allows, the whole width in one column tile if a row
    tile fits beside it; else `tiles`' (the output then re-laid out by XLA)."""
    if in_pieces(n, out_pieces):
        try:
            return (*tiles(m, n, k, e, fmt, x_itemsize, w_itemsize, whole_width=True), True)
        except ValueError:
            pass
    return (*tiles(m, n, k, e, fmt, x_itemsize, w_itemsize), False)


def _x_operand(x, k: int, fmt: str | None, rows: int):
    """x `[M, K]` or `[M, P, K/P]` as the kernel reads it: rows up to `rows` (whole tiles) and
    columns up to whole lanes, as zeros (x is small beside the weights, and zeros past K cancel
    the weight tile's columns there); in its pieces where `in_pieces` allows, else `[rows, K']`."""
    m = x.shape[0]
    if x.ndim == 3 and in_pieces(k, x.shape[1], fmt):
        return jnp.pad(x, ((0, rows - m), (0, 0), (0, 0)))
    return jnp.pad(x.reshape(m, k), ((0, rows - m), (0, x_columns(k, fmt) - k)))


def grouped_matmul_tpu(x, values, group_sizes, *, fmt: str | None = None, scale=None, layer=None,
                       interpret: bool = False, block_shape: tuple[int, int] | None = None, out_pieces: int = 1):
    """x `[M, K]` (bf16 or fp32, rows sorted by group) times each group's expert transposed:
    `[M, N]` in x's dtype, rows past sum(group_sizes) zero.

    x may also come as `[M, P, K/P]`, and the output go as `[M, out_pieces, N/out_pieces]`: each
    row in pieces, the layout in which XLA moves bf16 rows through a ragged all-to-all on TPU
    (a row's pieces are a (2, 128) tile's two sublanes, so that every row is contiguous) and
    which it re-lays out for a kernel that takes `[M, K]`; the kernel reads and writes it in
    place (the block's reshape is done in VMEM) where `in_pieces` allows, the output in one
    column tile (TN = N).

    values: a plain stack `[E, N, K]` (fmt None, bf16 or fp32), FP8 e4m3 `[E, N, K]` with
    `scale` float32 `[E, ceil(N/128), ceil(K/128)]` (fmt "fp8"), or FP4 uint8 `[E, N, K/2]` with
    `scale` uint8 `[E, N, ceil(K/32)]` (fmt "fp4"); with `layer` (int32 scalar, may be traced)
    both have a leading layer axis `[L, ...]` and layer `layer` is used. group_sizes int32 `[E]`,
    sum <= M (not checked). block_shape overrides (TM, TN) (TM a multiple of 16, TN of 128)."""
    layered = layer is not None
    m, k, e, n, kv = operand_shapes("grouped_matmul_tpu", x.reshape(x.shape[0], -1), values, fmt, layered)
    if out_pieces < 1 or n % out_pieces:
        raise ValueError(f"grouped_matmul_tpu: out_pieces {out_pieces} does not divide N = {n}")
    if block_shape:
        (tm, tn), pieces = block_shape, in_pieces(n, out_pieces) and block_shape[1] == n
    else:
        tm, tn, pieces = output_tiles(m, n, k, e, fmt, x.dtype.itemsize, values.dtype.itemsize, out_pieces)
    _check_block(tm, tn)
    m_tiles = pl.cdiv(m, tm)
    out = _call(_x_operand(x, k, fmt, m_tiles * tm), [(values, scale)], group_sizes, m_tiles, tm, tn, fmt=fmt,
                layer=layer, k=k, n=n, chosen=min(e, m), interpret=interpret,
                out_pieces=out_pieces if pieces else 1)[:m]
    return out.reshape((m, out_pieces, n // out_pieces) if out_pieces > 1 else (m, n))


def grouped_swiglu_tpu(x, w1, w3, group_sizes, hw, *, fmt: str | None = None, limit: float, layer=None,
                       interpret: bool = False, block_shape: tuple[int, int] | None = None):
    """The routed experts' first half in one kernel: `swiglu(x w1_g^T, x w3_g^T, limit) * hw` for
    the rows of each group g, each product rounded to x's dtype first (as `grouped_matmul_tpu`
    returns it), the rest in fp32, the result rounded to x's dtype: `[M, N]`, rows past
    sum(group_sizes) zero (their hw is not used: it may be unset). x `[M, K]` or `[M, P, K/P]`
    and w1, w3 (values, scale) as `grouped_matmul_tpu` takes them, alike in format and shape; hw
    fp32 `[M]`, the rows' routing weights. The grouped kernel's grid with both weights' tiles at
    each step: a group's first step dequantizes both, x's row tile is read once for the two
    products, and neither product goes through HBM (against two `grouped_matmul_tpu` calls and
    XLA's activation, which read x twice per column tile and move three `[M, N]` arrays more).
    block_shape as `grouped_matmul_tpu`'s."""
    (v1, s1), (v3, s3) = w1, w3
    layered = layer is not None
    m, k, e, n, kv = operand_shapes("grouped_swiglu_tpu", x.reshape(x.shape[0], -1), v1, fmt, layered)
    if v1.shape != v3.shape or (s1 is None) != (s3 is None) or (s1 is not None and s1.shape != s3.shape) \
            or hw.shape != (m,):
        raise ValueError(f"grouped_swiglu_tpu: w1 {list(v1.shape)} and w3 {list(v3.shape)} must match (and their "
                         f"scales), hw {tuple(hw.shape)} must be [M] for x {tuple(x.shape)}")
    tm, tn = block_shape or tiles(m, n, k, e, fmt, x.dtype.itemsize, v1.dtype.itemsize, weights=2)
    _check_block(tm, tn)
    m_tiles = pl.cdiv(m, tm)
    x = _x_operand(x, k, fmt, m_tiles * tm)
    hw = jnp.pad(hw.astype(jnp.float32), (0, m_tiles * tm - m))[:, None]  # [M, 1]: a column per row tile
    return _call(x, [w1, w3], group_sizes, m_tiles, tm, tn, fmt=fmt, layer=layer, k=k, n=n, chosen=min(e, m),
                 interpret=interpret, swiglu_of=(hw, limit))[:m]


def block_diagonal_supported(k: int, n: int, fmt: str | None, head_dim: int | None) -> bool:
    """Whether `block_diagonal_matmul_tpu` reads x `[M, E*K]` in place for an output `[M, E*N]`:
    its blocks must be whole lanes (K and N multiples of 128; plain or FP8, whose K needs no
    repacking), and with rope, heads of whole lanes."""
    return k % LANES == 0 and n % LANES == 0 and fmt != "fp4" and (head_dim is None or (
        head_dim % LANES == 0 and k % head_dim == 0))


def rope_lanes(x_rope, head_dim: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The lanes that rotate each row's heads back (`rotated_lanes`): its rope x_rope = (cos,
    sin) `[M, r/2]` as the lanes of a head's last W = r rounded up to 128 columns, fp32 `[M, W]`
    each: cos, and sin signed for the inverse's pair member (+sin on the even dim, -sin on the
    odd one); 1 and 0 on the NoPE lanes."""
    cos, sin = (a.astype(jnp.float32) for a in x_rope)
    m, half = cos.shape
    w = min(head_dim, _round(2 * half, LANES))
    signed = jnp.stack([sin, -sin], axis=-1).reshape(m, 2 * half)
    return (jnp.concatenate([jnp.ones((m, w - 2 * half), jnp.float32), jnp.repeat(cos, 2, axis=-1)], axis=1),
            jnp.concatenate([jnp.zeros((m, w - 2 * half), jnp.float32), signed], axis=1))


def block_diagonal_matmul_tpu(x, values, *, fmt: str | None = None, scale=None, layer=None, x_rope=None,
                              head_dim: int | None = None, interpret: bool = False):
    """x `[M, E*K]` times the block-diagonal weight of values' E blocks `[E, N, K]` (as
    `grouped_matmul_tpu` takes them; `[L, E, ...]` with `layer`): `[M, E*N]`, x's columns
    g K .. (g + 1) K - 1 times block g transposed into columns g N .. (g + 1) N - 1. The grouped
    kernel over E groups of M rows whose index maps read group g's rows in place in x's column
    block g and write them into the output's (`block_diagonal_supported` shapes; ValueError
    otherwise). With x_rope = (cos, sin) fp32 `[M, r/2]`: x's columns are heads of head_dim
    whose last r dims are rotated at each row's angle, and the kernel rotates them back in VMEM
    (`rotate_heads(..., inverse=True)`'s rounding) before the product."""
    layered = layer is not None
    e = values.shape[-3]
    m, ek = x.shape
    k = ek // e
    grouped = jax.ShapeDtypeStruct((m * e, k), x.dtype)
    _, _, _, n, _ = operand_shapes("block_diagonal_matmul_tpu", grouped, values, fmt, layered)
    if ek % e or not block_diagonal_supported(k, n, fmt, head_dim if x_rope is not None else None):
        raise ValueError(f"block_diagonal_matmul_tpu: x {tuple(x.shape)}, a {fmt or 'plain'} weight "
                         f"{list(values.shape)} and head_dim {head_dim}: the blocks are not whole lanes")
    tm, tn = tiles(m, n, k, 1, fmt, x.dtype.itemsize, values.dtype.itemsize)
    if vmem_bytes(tm, n, n, k, 1, fmt, x.dtype.itemsize, values.dtype.itemsize) <= VMEM_BUDGET:
        tn = n  # x's row tile is fetched once per column tile: one, where the whole width fits
    m_tiles = pl.cdiv(m, tm)
    # Not padded to whole row tiles: a group's last tile reads past x's rows (rows of their own,
    # whatever they hold) and its writes past the output's are dropped.
    lanes = None if x_rope is None else rope_lanes(x_rope, head_dim)
    return _call(x, [(values, scale)], jnp.full((e,), m_tiles * tm, jnp.int32), m_tiles * e, tm, tn, fmt=fmt,
                 layer=layer, k=k, n=n, chosen=e, interpret=interpret, diagonal=_Diagonal(m, m_tiles, lanes, head_dim))


class _Diagonal(NamedTuple):
    """The block-diagonal form of `_call`: group g's rows are x's row tiles 0 .. m_tiles - 1 at
    its column block g (and the output's), of its `rows` rows; lanes: the rows' rope lanes
    (`rope_lanes`) or None."""
    rows: int
    m_tiles: int
    lanes: tuple[jnp.ndarray, jnp.ndarray] | None
    head_dim: int | None


def _call(x, stored, group_sizes, m_tiles: int, tm: int, tn: int, *, fmt: str | None, layer, k: int, n: int,
          chosen: int, interpret: bool, diagonal: _Diagonal | None = None, swiglu_of=None, out_pieces: int = 1):
    """The pallas_call of `grouped_matmul_tpu`'s product over x padded to whole tiles (`[m_tiles
    TM, K']`, or in pieces `[m_tiles TM, P, K/P]`): `[m_tiles TM, N]`, or with out_pieces Q > 1
    (TN = N) `[m_tiles TM, Q, N/Q]`; or with `diagonal`, of `block_diagonal_matmul_tpu`'s over x
    as it is: `[rows, E N]`; or with swiglu_of = (hw `[m_tiles TM, 1]` fp32, limit), of
    `grouped_swiglu_tpu`'s. stored: the weights, (values, scale) each (two for the first half,
    alike). chosen: the most experts its rows may choose (the declared cost's)."""
    layered = layer is not None
    values = stored[0][0]
    e = values.shape[-3]
    kx = x_columns(k, fmt)
    m = m_tiles * tm
    steps = max_steps(m_tiles, m, e)
    meta = _metadata(group_sizes, m_tiles, tm, steps)
    kv_block = kx // 2 if fmt == "fp4" else kx

    def stack_map(block, by_group=True):  # index map of a weight array: the layer first when stacked
        def index(j, t, group, tile, x_tile, offsets, live, layer_ref):
            return (((layer_ref[0],) if layered else ()) + ((group[t],) if by_group else ()) + block(j))
        return index

    layer_axis = (None,) if layered else ()
    lanes = () if diagonal is None or diagonal.lanes is None else diagonal.lanes
    if diagonal is None:
        x_spec = pl.BlockSpec((tm,) + x.shape[1:],  # (rows in pieces: whole rows)
                              lambda j, t, group, tile, x_tile, *_: (x_tile[t],) + (0,) * (x.ndim - 1))
        if out_pieces > 1:
            out_spec = pl.BlockSpec((tm, out_pieces, n // out_pieces), lambda j, t, group, tile, *_: (tile[t], 0, 0))
            out_shape = (m, out_pieces, n // out_pieces)
        else:
            out_spec = pl.BlockSpec((tm, tn), lambda j, t, group, tile, *_: (tile[t], j))
            out_shape = (m, n)
    else:  # group g's row tile r: x's row tile r at column block g, and the output's
        mt = diagonal.m_tiles
        # (lax's div and rem: jnp's floor forms lower to a sign that Mosaic's index maps lack)
        x_spec = pl.BlockSpec((tm, kx), lambda j, t, group, tile, x_tile, *_: (jax.lax.rem(x_tile[t], mt),
                                                                             jax.lax.div(x_tile[t], mt)))
        out_spec = pl.BlockSpec((tm, tn), lambda j, t, group, tile, *_: (jax.lax.rem(tile[t], mt),
                                                                       jax.lax.div(tile[t], mt) * (n // tn) + j))
        out_shape = (diagonal.rows, e * n)
    lane_specs = [pl.BlockSpec((tm, a.shape[1]), lambda j, t, group, tile, x_tile, *_: (jax.lax.rem(x_tile[t], mt), 0))
                  for a in lanes]
    in_specs, operands = [x_spec, *lane_specs], [x, *lanes]
    scratch = []
    scales_transposed = False
    s_read = 0  # scale bytes read of a weight: FP4 all of a chosen expert's, FP8 the whole layer's
    for values, scale in stored:
        in_specs.append(pl.BlockSpec(layer_axis + (None, tn, kv_block), stack_map(lambda j: (j, 0))))
        operands.append(values)
        if fmt == "fp8":
            # The layer's scales with the expert minor (see the module doc), whole: one fetch.
            scale = jnp.moveaxis(scale, -3, -1)
            in_specs.append(pl.BlockSpec(layer_axis + tuple(scale.shape[-3:]), stack_map(lambda j: (0, 0, 0), False)))
            s_read = scale.shape[-3] * scale.shape[-2] * scale.shape[-1] * 4
        elif fmt == "fp4":
            g = scale.shape[-1]
            scales_transposed = g % LANES != 0
            if scales_transposed:
                scale = jnp.swapaxes(scale, -1, -2)  # [.., E, G, N]
                in_specs.append(pl.BlockSpec(layer_axis + (None, g, tn), stack_map(lambda j: (0, j))))
            else:
                in_specs.append(pl.BlockSpec(layer_axis + (None, tn, g), stack_map(lambda j: (j, 0))))
            s_read = n * g
        if fmt is not None:
            operands.append(scale)
            scratch.append(pltpu.VMEM((tn, kx), x.dtype))  # the weight's dequantized tile
    if fmt == "fp4":  # the scale bytes as int32, shared by the weights' dequantizations in turn
        g = stored[0][1].shape[-1]
        scratch.append(pltpu.VMEM((tn, _round(g, LANES)), jnp.int32))
        if scales_transposed:
            scratch.append(pltpu.VMEM((_round(g, LANES), tn), jnp.int32))
    row_operands = list(lanes)
    if swiglu_of is not None:
        hw, limit = swiglu_of
        in_specs.append(pl.BlockSpec((tm, 1), lambda j, t, group, tile, x_tile, *_: (x_tile[t], 0)))
        operands.append(hw)
        row_operands.append(hw)
    else:
        limit = None
    col_tiles = pl.cdiv(n, tn)
    # Declared cost, a static upper bound: the experts read are at most min(E, M) (the rows
    # choose no more), each expert's stored values and scales once per weight (FP8: the layer's
    # scales once); x (and the rows' rope lanes or routing weights) once per column tile; the
    # output once. The MXU runs TM rows on every computing step, once per weight.
    # (Block-diagonal: the same, x and the rope lanes fetched once per step and column tile.)
    read = len(stored) * (chosen * (n * values.shape[-1] * values.dtype.itemsize + (s_read if fmt == "fp4" else 0))
                          + (s_read if fmt == "fp8" else 0))
    per_row_operands = (e if diagonal is not None else 1) * sum(a.size * a.dtype.itemsize for a in row_operands)
    cost = pl.CostEstimate(flops=len(stored) * 2 * steps * tm * n * kx, transcendentals=0,
                           bytes_accessed=read + m * n * x.dtype.itemsize
                           + col_tiles * (x.size * x.dtype.itemsize + per_row_operands))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(col_tiles, steps),
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=scratch,
    )
    return pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, k_total=k, scales_transposed=scales_transposed,
                          head_dim=diagonal.head_dim if lanes else None, weights=len(stored), limit=limit),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype),
        # Column tiles may be split between TensorCores (v5p's megacore); the steps must run in
        # order on one core, since a group's later steps reuse its dequantized tiles.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=cost,
        interpret=interpret,
        name=NAME if swiglu_of is None else SWIGLU_NAME,
    )(*meta, layer_operand(layer), *operands)
