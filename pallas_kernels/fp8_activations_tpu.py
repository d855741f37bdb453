"""FP8 activations times a block-scaled FP8 weight, as DeepSeek's reference `fp8_gemm`: the Mosaic
TPU kernel (also run by the Pallas interpreter on CPU).

Operands as in fp8_activations_gpu.py: the activations as `act_quant` leaves them, e4m3 values
`[M, K]` and float32 power-of-two scales `[M, ceil(K/128)]`; the weight as stored, e4m3 values
`[N, K]` and float32 scales `[ceil(N/128), ceil(K/128)]`, of a stack of layers one read in place
(its index reaches the index maps by scalar prefetch).

Per 128x128 block of the output's columns and K, one dot of the e4m3 operands as they are, with
float32 results: TPU v7x's MXU multiplies FP8 (the compiled program's matmul takes f8e4m3fn
operands; a test checks it), and for MXUs that take none Mosaic widens the tiles on chip. The
block's partial is scaled by s_x[row, kb] * s_w[nb, kb] (the two scales multiplied first) and
added into a float32 accumulator in VMEM, in K order: `fp8_activation_matmul_ref`'s arithmetic,
the sums inside a block in the MXU's order.

Tiling as `quantized_matmul`'s TPU kernel: grid (row tiles of x, column tiles of the output, K
tiles), K innermost; every stored weight byte is read from HBM once per row tile of x (once in
all at decode), the weight scales whole into SMEM once. x's row tile stays in VMEM for the grid
when it fits, and its scales `[TM, ceil(K/128)]` with it; a block's column of them is taken by a
masked sum over the lanes (exact: one term is not zero), not by a lane slice at a traced
offset. Rows are padded to the row tile and K to the 128 block
(x only: zeros); when K is not a multiple of 128 the weight's last block of each K tile is
masked past K (what lies past an array's end in VMEM is undefined, and an e4m3 NaN times zero is
NaN), widened to bf16 (exact) for the select: the published weights' K are multiples.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._dispatch import layer_operand
from .quantized_matmul_tpu import BLOCK, MAX_TM, VMEM_LIMIT, weight_read, x_tiles
from .quantized_matmul_tpu import tiles as bf16_tiles

ROWS = 32  # a tile of e4m3 rows (four to a 32-bit sublane word)
KERNEL_NAME = "dsv4_fp8_activation_matmul"


def tiles(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(TM, TN, TK): `quantized_matmul`'s tiles (`quantized_matmul_tpu.tiles`), the rows in
    whole e4m3 tiles of ROWS."""
    _, tn, tk = bf16_tiles(m, n, k)
    return min(MAX_TM, pl.cdiv(m, ROWS) * ROWS), tn, tk


def _kernel(layer_ref, q_ref, sx_ref, v_ref, sw_ref, o_ref, acc_ref, *, k_total: int, tk: int):
    j, k = pl.program_id(1), pl.program_id(2)
    tn = v_ref.shape[0]

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    rows_s, cols_s = sw_ref.shape
    x_start = 0 if q_ref.shape[1] == tk else pl.multiple_of(k * tk, BLOCK)
    sx_all = sx_ref[...]  # [TM, ceil(K/128)]
    lane = jax.lax.broadcasted_iota(jnp.int32, sx_all.shape, 1)
    for kb in range(tk // BLOCK):
        xb = q_ref[:, pl.ds(x_start + kb * BLOCK, BLOCK)]
        block = k * (tk // BLOCK) + kb
        sx = jnp.sum(jnp.where(lane == block, sx_all, 0.0), axis=1, keepdims=True)  # [TM, 1]
        col = jnp.minimum(block, cols_s - 1)
        tail = k_total % BLOCK and kb == tk // BLOCK - 1  # the last K block may reach past K
        if tail:
            inside = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1) < k_total - block * BLOCK
            xb = xb.astype(jnp.bfloat16)
        for nb in range(tn // BLOCK):
            wb = v_ref[pl.ds(nb * BLOCK, BLOCK), pl.ds(kb * BLOCK, BLOCK)]
            if tail:
                wb = jnp.where(inside, wb.astype(jnp.bfloat16), jnp.zeros(wb.shape, jnp.bfloat16))
            # Precision stated, not left to jax_default_matmul_precision: Mosaic takes e4m3 (and
            # bf16) operands only at the default, and the products are exact at any.
            part = jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.DEFAULT,
                                       preferred_element_type=jnp.float32)
            # A block past the weight's end reads the last scale (its rows are dropped).
            sw = sw_ref[jnp.minimum(j * (tn // BLOCK) + nb, rows_s - 1), col]
            cols = pl.ds(nb * BLOCK, BLOCK)
            acc_ref[:, cols] = acc_ref[:, cols] + part * (sx * sw)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def fp8_activation_matmul_tpu(q, s, values, scale, *, out_dtype, layer=None, interpret: bool = False,
                              block_shape: tuple[int, int, int] | None = None):
    """q e4m3 `[M, K]` with its scales s float32 `[M, ceil(K/128)]` (`act_quant`) times the FP8
    weight (values e4m3 `[N, K]`, scale float32 `[ceil(N/128), ceil(K/128)]`) transposed:
    `[M, N]` in out_dtype. With `layer` (an int scalar, may be traced), values and scale are the
    stacks `[L, N, K]` and `[L, ...]` of every layer, of which layer `layer` is read in place.
    block_shape overrides (TM, TN, TK) (TM a multiple of 32, TN and TK of 128)."""
    if layer is None:  # one layer: a stack of one (a bitcast)
        values, scale = values[None], scale[None]
    m, k = q.shape
    n = values.shape[1]
    tm, tn, tk = block_shape or tiles(m, n, k)
    padded_k = pl.cdiv(k, BLOCK) * BLOCK
    if s.shape != (m, padded_k // BLOCK):
        raise ValueError(f"scales s {list(s.shape)} for q {list(q.shape)}: needs [{m}, {padded_k // BLOCK}]")
    if tm % ROWS or tn % BLOCK or tk % BLOCK or padded_k % tk:
        raise ValueError(f"TM must be a multiple of {ROWS}, TN of {BLOCK} and TK of {BLOCK} dividing K rounded "
                         f"up to {BLOCK} ({padded_k}), got {tm}, {tn}, {tk}")
    grid = (pl.cdiv(m, tm), pl.cdiv(n, tn), padded_k // tk)
    padded_m = grid[0] * tm
    q = jnp.pad(q, ((0, padded_m - m), (0, padded_k - k)))
    sx = jnp.pad(s.astype(jnp.float32), ((0, padded_m - m), (0, 0)), constant_values=1.0)
    x_spec, resident = x_tiles(q, tm, tk)
    # Every stored byte of the layer once per row tile of x, its scales once, x once (per column
    # tile when it is not resident) and its scales once, the output once.
    x_reads = 1 if resident else grid[1]
    cost = pl.CostEstimate(flops=2 * m * n * k, transcendentals=0,
                           bytes_accessed=weight_read(grid[0], values, scale) + x_reads * q.size * q.dtype.itemsize
                           + sx.size * sx.dtype.itemsize + m * n * jnp.dtype(out_dtype).itemsize)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=grid,
        in_specs=[x_spec,
                  pl.BlockSpec((tm, sx.shape[1]), lambda i, j, kk, l: (i, 0)),
                  pl.BlockSpec((None, tn, tk), lambda i, j, kk, l: (l[0], j, kk)),
                  pl.BlockSpec((None,) + scale.shape[1:], lambda i, j, kk, l: (l[0], 0, 0),
                               memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk, l: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, k_total=k, tk=tk),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((padded_m, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=cost,
        interpret=interpret,
        name=KERNEL_NAME,
    )(layer_operand(layer), q, sx, values, scale)[:m]
