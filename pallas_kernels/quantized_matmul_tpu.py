"""x times a block-scaled FP8 weight: the Mosaic TPU kernel (also run by the Pallas interpreter
on CPU).

The weight stays as stored (`dsv4_jax/model/quantized.py`): e4m3 values `[N, K]` and float32 scales
`[ceil(N/128), ceil(K/128)]`, one per 128x128 block. The grid is (row tiles of x, column tiles of
the output, K tiles), K innermost, and each grid step brings a `[TN, TK]` tile of the values and
the scales come whole into SMEM once: every stored byte is read from HBM once per row tile of x
(once in all when x fits one row tile, as in decode), every scale once. Of a stack of layers'
weights, one layer is read in place: its index reaches the index maps by scalar prefetch. The tile is
dequantized block by block in VMEM exactly as `QuantizedWeight.dequantize` does it (value times
scale in float32, rounded once to x's dtype), then multiplied with float32 accumulation:
`x @ w.T` with the same products, summed in another order.

K and N need not be multiples of the tiles: the last K tile masks the columns past K in both x
and the weight (what lies past an array's end in VMEM is undefined, and an e4m3 NaN times zero
is NaN), and rows past N are computed and dropped.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._dispatch import layer_operand

BLOCK = 128  # the FP8 scale block, and the lane width
ROWS = 16  # a tile of bf16 rows
MAX_TM = 512  # rows of x per tile: a prefill chunk of up to 512 tokens reads the weight once
MAX_TN = 512
MAX_TK = 1024
# A row tile of x up to this size stays in VMEM for the whole grid, read once (a 512-token bf16
# chunk of Pro's hidden size fits); a larger one is read once per column tile.
X_RESIDENT_BYTES = 8 << 20
VMEM_LIMIT = 48 << 20


def tiles(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(TM, TN, TK) for x `[m, k]` and a weight `[n, k]`: TM the rows of x rounded up to ROWS,
    up to MAX_TM; TN a multiple of the 128 block up to MAX_TN; TK the largest multiple of 128 up
    to MAX_TK that divides K rounded up to 128 (so x's row tile, kept whole in VMEM, is sliced
    within its padded width), so that a grid step moves enough bytes to hide its fixed cost."""
    tm = min(MAX_TM, pl.cdiv(m, ROWS) * ROWS)
    tn = min(MAX_TN, pl.cdiv(n, BLOCK) * BLOCK)
    blocks = pl.cdiv(k, BLOCK)
    tk = BLOCK * max(d for d in range(1, MAX_TK // BLOCK + 1) if blocks % d == 0)
    return tm, tn, tk


def x_tiles(x, tm: int, tk: int) -> tuple[pl.BlockSpec, bool]:
    """The BlockSpec of x `[M, K]` over the grid (i, j, k, layer): its row tile whole (`[TM, K
    rounded up to 128]`: fetched once, sliced per K step in VMEM) when that fits
    X_RESIDENT_BYTES, else `[TM, TK]` per K step; and whether it is whole."""
    padded_k = pl.cdiv(x.shape[1], BLOCK) * BLOCK
    if tm * padded_k * x.dtype.itemsize <= X_RESIDENT_BYTES:
        return pl.BlockSpec((tm, padded_k), lambda i, j, kk, l: (i, 0)), True
    return pl.BlockSpec((tm, tk), lambda i, j, kk, l: (i, kk)), False


def weight_read(row_tiles: int, values, scale) -> int:
    """The HBM bytes of one layer's FP8 weight (values `[L, N, K]`, scale `[L, ...]`) that a grid
    with `row_tiles` row tiles of x reads: the values once per row tile, the scales once."""
    return (row_tiles * math.prod(values.shape[1:]) * values.dtype.itemsize
            + math.prod(scale.shape[1:]) * scale.dtype.itemsize)


def _kernel(layer_ref, x_ref, v_ref, s_ref, o_ref, w_ref, acc_ref, *, k_total: int, tk: int):
    j, k = pl.program_id(1), pl.program_id(2)
    tm, tn = x_ref.shape[0], v_ref.shape[0]

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    rows_s, cols_s = s_ref.shape
    for nb in range(tn // BLOCK):
        for kb in range(tk // BLOCK):
            # A block past the weight's end reads the last scale (its rows are dropped, its
            # columns masked below).
            scale = s_ref[jnp.minimum(j * (tn // BLOCK) + nb, rows_s - 1), jnp.minimum(k * (tk // BLOCK) + kb, cols_s - 1)]
            rows, cols = pl.ds(nb * BLOCK, BLOCK), pl.ds(kb * BLOCK, BLOCK)
            w_ref[rows, cols] = (v_ref[rows, cols].astype(jnp.float32) * scale).astype(w_ref.dtype)
    x = x_ref[...] if x_ref.shape[1] == tk else x_ref[:, pl.ds(pl.multiple_of(k * tk, BLOCK), tk)]
    w = w_ref[...]
    if k_total % tk:  # the last K tile reaches past K
        limit = k_total - k * tk
        x = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (tm, tk), 1) < limit, x, jnp.zeros_like(x))
        w = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (tn, tk), 1) < limit, w, jnp.zeros_like(w))
    # Stated, not left to jax_default_matmul_precision: Mosaic rejects a bf16 product at fp32
    # precision, and an fp32 one must stay fp32.
    precision = jax.lax.Precision.DEFAULT if x.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST
    acc_ref[...] += jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                        preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def fp8_matmul_tpu(x, values, scale, *, layer=None, interpret: bool = False,
                   block_shape: tuple[int, int, int] | None = None):
    """x `[M, K]` (bf16 or fp32) times the FP8 weight (values e4m3 `[N, K]`, scale float32
    `[ceil(N/128), ceil(K/128)]`) transposed: `[M, N]` in x's dtype. With `layer` (an int
    scalar, may be traced), values and scale are the stacks `[L, N, K]` and `[L, ...]` of every
    layer, of which layer `layer` is read in place (its index goes to the index maps by scalar
    prefetch: a slice of the stack, as a kernel operand, would be a copy). block_shape overrides
    (TM, TN, TK) (TN, TK multiples of 128)."""
    if layer is None:  # one layer: a stack of one (a bitcast)
        values, scale = values[None], scale[None]
    m, k = x.shape
    n = values.shape[1]
    tm, tn, tk = block_shape or tiles(m, n, k)
    if tn % BLOCK or tk % BLOCK:
        raise ValueError(f"TN and TK must be multiples of {BLOCK}, got {tn}, {tk}")
    if m < tm and k % tk:  # Mosaic masks whole row tiles only: a few rows are padded to one
        x = jnp.pad(x, ((0, tm - m), (0, 0)))
    grid = (pl.cdiv(m, tm), pl.cdiv(n, tn), pl.cdiv(k, tk))
    x_spec, resident = x_tiles(x, tm, tk)
    # Every stored byte of the layer once per row tile of x, its scales once, x once (per column
    # tile when it is not resident), the output once.
    x_reads = 1 if resident else grid[1]
    cost = pl.CostEstimate(flops=2 * m * n * k, transcendentals=0,
                           bytes_accessed=weight_read(grid[0], values, scale)
                           + x_reads * x.size * x.dtype.itemsize + m * n * x.dtype.itemsize)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=grid,
        in_specs=[x_spec,
                  pl.BlockSpec((None, tn, tk), lambda i, j, kk, l: (l[0], j, kk)),
                  pl.BlockSpec((None,) + scale.shape[1:], lambda i, j, kk, l: (l[0], 0, 0),
                               memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk, l: (i, j)),
        scratch_shapes=[pltpu.VMEM((tn, tk), x.dtype), pltpu.VMEM((tm, tn), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, k_total=k, tk=tk),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=cost,
        interpret=interpret,
        name="dsv4_fp8_matmul",
    )(layer_operand(layer), x, values, scale)[:m]
