"""x times a block-scaled FP8 weight kept as stored: the GPU kernel (Hopper, sm_90a), written in
Pallas-Triton (also run by the Pallas interpreter on CPU).

Operands as `dsv4_jax/model/quantized.py` stores them: x `[M, K]` (bf16 or fp32), e4m3 values `[N, K]`
and float32 scales `[ceil(N/128), ceil(K/128)]` (one per 128x128 block); the result `[M, N]` is
in x's dtype, accumulated in fp32.

Why Triton and not Mosaic GPU: this is a dense tiled matmul whose weight operand is
transformed (fp8 -> fp32 -> times scale -> x's dtype) between HBM and the tensor cores. In
Triton that is one `dot` of register values: the compiler stages the dequantized tile in shared
memory for the MMA (wgmma for 64+ row tiles, mma.sync below: both seen in the PTX for sm_90a),
pipelines the K loop's loads (`num_stages`, cp.async), and masked loads handle the tails. In
Mosaic GPU (jax 0.10.2) the same needs a hand-written register -> tiled, swizzled SMEM store
before `wgmma`; the repo's Mosaic GPU kernels do without tensor cores (mgpu_probe.py records how
far that path got), and without them a 512-token prefill would run at the CUDA cores' rate. This
was not probed further here: Triton compiled for sm_90a at the first try. Costs of the choice:
the custom call is XLA's Triton call (`__gpu$xla.gpu.triton`, `KERNEL_NAME` in its op_name and
backend config), not a Mosaic one, so the Mosaic ptxas dump does not see it; and neither GPU
lowering passes a `pl.CostEstimate` on to XLA, so the declared estimate also goes into the
op_name (`_dispatch.declared_cost_scope`), where dsv4-plan reads it.

Tiling: grid `(ceil(M / TM), ceil(N / TN))`, both parallel; each program keeps an fp32
accumulator `[TM, TN]` in registers and loops over K in steps of TK (128, one scale block; 32
for fp32 x). A step loads x `[TM, TK]` (masked: rows past M and columns past K read as 0) and
the values `[TN, TK]` (masked likewise, and zeroed after widening to fp32: what a masked lane
holds is undefined, and an e4m3 NaN times a zero of x is NaN), the one scale covering the tile
(TN and TK divide 128, so a tile never straddles two scale blocks), dequantizes in registers
exactly as `QuantizedWeight.dequantize` (value times scale in fp32, rounded once to x's dtype)
and accumulates `x @ w.T` in fp32 (bf16: tensor cores; fp32: IEEE fp32 products, not TF32, as
the reference). So every stored byte and scale is loaded once per row tile of x (the row tiles
of a column tile run together: from HBM once, from L2 after), x once per column tile (from L2
after the first when it fits there), the output written once; the declared cost counts the HBM
bytes (`fp8_matmul_gpu`).
  * Decode (M <= 64): one row tile (TM = M rounded up to a power of two, at least 16, the MMA's
    smallest), so the weight is read exactly once; TN is halved from 128 (down to 16) until at
    least `MIN_PROGRAMS` programs (two per SM) stream the weight in parallel, since at this M
    the loads are the work. 4 warps, 4 pipeline stages.
  * Prefill (M > 64): 128 x 128 output tiles (8 warps: two warpgroups' wgmma), halved (TN
    first, to 64) while there are fewer programs than SMs: the weight is read ceil(M / TM) times,
    4 for a 512-token chunk (L2 serves part of it when a column's row tiles run together).
  * fp32 x (small test models): at most 2048 outputs per tile and TK = 32, see `FP32_TILE`.
Not done: split-K. A decode shape with few output rows (N = 1536: 96 programs of 16 rows)
leaves SMs idle; splitting K would fill them, at the price of a second pass over fp32 partials.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._dispatch import declared_cost_scope, layer_operand

KERNEL_NAME = "dsv4_fp8_matmul_gpu"
BLOCK = 128  # the FP8 scale block: TN and TK divide it, so that one scale covers a tile
MIN_ROWS = 16  # the MMA's smallest tile side
DECODE_M = 64  # up to this many rows of x: one row tile, the weight read exactly once
# fp32 x: IEEE products on the CUDA cores, whose operands and accumulator sit in registers:
# at most 2048 outputs per tile and 32 K columns per step keep 4 warps under 255 registers
# without spills (ptxas: 64 x 64 spills, 64 x 32 and 32 x 64 use 176 and 190).
FP32_TK = 32
FP32_TILE = 2048
SMS = 132  # an H100's (and H200's) streaming multiprocessors
L2_BYTES = 50 << 20  # an H100's (and H200's) L2 cache: what serves a tile's re-reads
MIN_PROGRAMS = 2 * SMS  # decode: enough loads in flight to stream the weight


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << max(v - 1, 0).bit_length())


def tiles(m: int, n: int, dtype) -> tuple[int, int, int]:
    """(TM, TN, TK) for x `[m, K]` of `dtype` and a weight `[n, K]` (see the module doc); all
    powers of two (Triton's block shapes), TN and TK dividing 128."""
    fp32 = jnp.dtype(dtype) == jnp.float32
    tk = FP32_TK if fp32 else BLOCK
    if m <= DECODE_M:
        tm = _pow2_at_least(m, MIN_ROWS)
        tn = min(BLOCK, FP32_TILE // tm) if fp32 else BLOCK
        while tn > MIN_ROWS and pl.cdiv(n, tn) < MIN_PROGRAMS:
            tn //= 2
        return tm, tn, tk
    if fp32:
        return FP32_TILE // 64, 64, tk
    tm = tn = BLOCK
    # Fewer programs than SMs leaves SMs idle: smaller tiles, down to one warpgroup's 64 rows
    # (TN first: a column tile re-reads x, a row tile the weight, both mostly from L2).
    while pl.cdiv(m, tm) * pl.cdiv(n, tn) < SMS and max(tm, tn) > 64:
        if tn >= tm:
            tn //= 2
        else:
            tm //= 2
    return tm, tn, tk


def _kernel(layer_ref, x_ref, v_ref, s_ref, o_ref, *, m: int, n: int, k: int, tm: int, tn: int, tk: int):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows = i * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    outs = j * tn + jax.lax.broadcasted_iota(jnp.int32, (tn, 1), 0)
    f32 = jnp.float32
    # Stated, not left to jax_default_matmul_precision: bf16 products on the tensor cores, fp32
    # ones in IEEE fp32 (the default would be TF32, 10 mantissa bits).
    precision = (jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if x_ref.dtype == jnp.bfloat16
                 else jax.lax.Precision.HIGHEST)
    scale_row = (j * tn) // BLOCK

    def step(kb, acc):
        cols = kb * tk + jax.lax.broadcasted_iota(jnp.int32, (1, tk), 1)
        x = pltriton.load(x_ref.at[pl.ds(i * tm, tm), pl.ds(kb * tk, tk)],
                          mask=(rows < m) & (cols < k), other=0)
        inside = (outs < n) & (cols < k)
        # No `other` for the values: Triton has no e4m3 constant to fill with. What a masked
        # lane holds is undefined (an e4m3 NaN, say), so it is zeroed after the widening.
        v = pltriton.load(v_ref.at[layer, pl.ds(j * tn, tn), pl.ds(kb * tk, tk)], mask=inside)
        v = jnp.where(inside, v.astype(f32), 0.0)
        w = (v * s_ref[layer, scale_row, (kb * tk) // BLOCK]).astype(x.dtype)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, tk), step, jnp.zeros((tm, tn), f32))
    pltriton.store(o_ref.at[pl.ds(i * tm, tm), pl.ds(j * tn, tn)], acc.astype(o_ref.dtype),
                   mask=(rows < m) & (outs.reshape(1, tn) < n))


def fp8_matmul_gpu(x, values, scale, *, layer=None, interpret: bool = False,
                   block_shape: tuple[int, int, int] | None = None):
    """x `[M, K]` (bf16 or fp32) times the FP8 weight (values e4m3 `[N, K]`, scale float32
    `[ceil(N/128), ceil(K/128)]`) transposed: `[M, N]` in x's dtype. With `layer` (an int
    scalar, may be traced), values and scale are the stacks `[L, N, K]` and `[L, ...]` of every
    layer, of which layer `layer` is read in place (the kernel offsets its loads by it: a slice
    of the stack, as a kernel operand, would be a copy). block_shape overrides (TM, TN, TK):
    powers of two, TM >= 16, TN and TK from 16 to 128."""
    if layer is None:  # one layer: a stack of one (a bitcast)
        values, scale = values[None], scale[None]
    m, k = x.shape
    n = values.shape[1]
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    tm, tn, tk = block_shape or tiles(m, n, x.dtype)
    if any(t & (t - 1) for t in (tm, tn, tk)) or min(tm, tn, tk) < MIN_ROWS or max(tn, tk) > BLOCK:
        raise ValueError(f"TM, TN, TK must be powers of two, at least {MIN_ROWS}, TN and TK at most {BLOCK}; "
                         f"got {tm}, {tn}, {tk}")
    grid = (pl.cdiv(m, tm), pl.cdiv(n, tn))
    itemsize = x.dtype.itemsize
    # HBM bytes: programs launch row tile fastest, so the row tiles of one column tile read its
    # weight together (L2 serves all but the first): the stored weight once; x once when it fits
    # in a quarter of L2 (its column tiles' re-reads come from there), else once per column
    # tile; the output once.
    stored = n * k * values.dtype.itemsize + math.prod(scale.shape[1:]) * scale.dtype.itemsize
    x_reads = 1 if 4 * m * k * itemsize <= L2_BYTES else grid[1]
    cost = pl.CostEstimate(flops=2 * m * n * k, transcendentals=0,
                           bytes_accessed=stored + x_reads * m * k * itemsize + m * n * itemsize)
    warps = 8 if tm * tn >= BLOCK * BLOCK else 4
    with declared_cost_scope(cost):
        return pl.pallas_call(
            functools.partial(_kernel, m=m, n=n, k=k, tm=tm, tn=tn, tk=tk),
            grid=grid,
            out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=4 if m <= DECODE_M else 3),
            cost_estimate=cost,
            interpret=interpret,
            name=KERNEL_NAME,
        )(layer_operand(layer), x, values, scale)
