"""FP8 activations times a block-scaled FP8 weight, as DeepSeek's reference `fp8_gemm`: the GPU
kernel (Hopper, sm_90a), written in Pallas-Triton (also run by the Pallas interpreter on CPU).

Operands: the activations as `act_quant` (fp8_activations_ref.py) leaves them, e4m3 values
`[M, K]` and float32 power-of-two scales `[M, ceil(K/128)]`, and the weight as
`dsv4_jax/model/quantized.py` stores it, e4m3 values `[N, K]` and float32 scales
`[ceil(N/128), ceil(K/128)]`; the result `[M, N]` is in the requested dtype.

Per 128-wide K block, an e4m3 x e4m3 dot on the FP8 tensor cores (`wgmma ... f32.e4m3.e4m3`,
seen in the PTX for sm_90a; the tests check it), exact products summed by the MMA from zero; the
block's partial is scaled by s_x[row, kb] * s_w[nb, kb] and added into an fp32 accumulator in
registers, in K order. This is the reference's own promotion: Hopper's FP8 MMA accumulates with
fewer bits than fp32 (about 14 in DeepSeek-V3's report), so DeepSeek's `fp8_gemm` sums at most
one 128-wide block in the MMA and the rest on the CUDA cores, and so does this kernel. Against
`fp8_activation_matmul_ref` (fp32 sums everywhere) it differs on a GPU by the MMA's in-block
accumulation; in the interpreter only by the order of the in-block sums.

Why the dot is our own primitive (`_fp8_block_dot`) and not `lax.dot_general`: Triton emits FP8
wgmma only for a dot whose `max_num_imprecise_acc` allows the MMA's accumulation (at least 32
K); with the attribute unset, as Pallas's dot_general lowering leaves it, it falls back to
mma.sync on f16 (the e4m3 tiles widened in registers: at most f16's peak, half the FP8 one, and
less through mma.sync than through wgmma). The primitive's Triton lowering is Pallas's (operand B transposed, a zero
accumulator) with that attribute set to one block; elsewhere (the Pallas interpreter, XLA) it is
`lax.dot_general` with fp32 results. The lowering is registered in jax's private table of
Pallas-Triton rules (`jax._src.pallas.triton.lowering`): no public API sets the attribute in
jax 0.10.2.

The activations are quantized before the kernel (an XLA fusion, `act_quant`), not in its x
load. Fused, each of the grid's column tiles would quantize its row tile again: at decode that
is hundreds of programs redoing the same rows, and in a prefill tile the per-element amax,
scaling and cast run on the CUDA cores at a cost close to the FP8 MMA's own per K step; the
kernel would also load x in bf16, twice the bytes of its e4m3 values. Unfused, x is quantized
once and the quantization has one definition, the one the tests pin bit for bit.

Tiling: grid `(ceil(M / TM), ceil(N / TN))`, both parallel; each program loops over the K
blocks. A step loads x `[TM, 128]`, its scales `[TM]`, the values `[TN, 128]` (TN divides 128,
so one weight scale covers the tile) and that scale. Loads past M, N or K are masked. Lanes
past M or N reach only outputs that are not stored; lanes past K reach every output, and an e4m3
load has no fill value in Triton (no e4m3 constant), so when K is not a multiple of 128 the
masked lanes, undefined (an e4m3 NaN, say, and NaN times a zero is NaN), are zeroed on the
loaded bytes as int8 before the dot (the published weights' K are multiples: no extra work).
TM is at least 64, one warpgroup's wgmma rows: a smaller tile falls back to mma.sync on f16.
  * Decode (M <= 64): one row tile of 64, the weight read exactly once; the rows past M are
    masked loads (no traffic) and MMA work the FP8 rate absorbs (a decode step streams the
    weight: 2 * 64 flops per byte is far below an H100's ~590 FP8 flops per HBM byte). TN is
    halved from 128 (down to 16) until at least two programs per SM stream the weight. 4 warps,
    4 pipeline stages.
  * Prefill (M > 64, up to a chunk of thousands): 128 x 128 output tiles (8 warps: two
    warpgroups' wgmma), halved (TN first, to 64) while there are fewer programs than SMs.
    3 stages of 32 KiB (x and weight tiles in e4m3).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jaxlib.mlir import ir
from jaxlib.triton import dialect as tt_dialect

from ._dispatch import declared_cost_scope, layer_operand

KERNEL_NAME = "dsv4_fp8_activation_matmul_gpu"
BLOCK = 128  # the K block of both operands' scales, and the weight's N block: TN divides it
MIN_TM = 64  # one warpgroup's wgmma rows
MIN_TN = 16  # the narrowest weight tile (decode: 16 output rows per program)
DECODE_M = 64  # up to this many rows of x: one row tile, the weight read exactly once
SMS = 132  # an H100's (and H200's) streaming multiprocessors
L2_BYTES = 50 << 20  # an H100's (and H200's) L2 cache: what serves a tile's re-reads
MIN_PROGRAMS = 2 * SMS  # decode: enough loads in flight to stream the weight


def _block_dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# a `[TM, BLOCK]` e4m3 times b `[TN, BLOCK]` e4m3 transposed: `[TM, TN]` fp32 (see the module doc).
_fp8_block_dot = Primitive("dsv4_fp8_block_dot")
_fp8_block_dot.def_impl(_block_dot)
_fp8_block_dot.def_abstract_eval(lambda a, b: jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32))
mlir.register_lowering(_fp8_block_dot, mlir.lower_fun(_block_dot, multiple_results=False))


@triton_lowering.register_lowering(_fp8_block_dot)
def _fp8_block_dot_triton(ctx, a, b):
    [out] = ctx.avals_out
    zeros = triton_lowering._zeros(ir.RankedTensorType.get(out.shape, ir.F32Type.get()))
    return tt_dialect.dot(a, tt_dialect.trans(b, (1, 0)), zeros, max_num_imprecise_acc=BLOCK)


def tiles(m: int, n: int) -> tuple[int, int]:
    """(TM, TN) for x `[m, K]` and a weight `[n, K]` (see the module doc): powers of two, TM at
    least 64, TN dividing 128."""
    if m <= DECODE_M:
        tm, tn = MIN_TM, BLOCK
        while tn > MIN_TN and pl.cdiv(n, tn) < MIN_PROGRAMS:
            tn //= 2
        return tm, tn
    tm = tn = BLOCK
    # Fewer programs than SMs leaves SMs idle: smaller tiles, down to one warpgroup's 64 rows
    # (TN first: a column tile re-reads x, a row tile the weight, both mostly from L2).
    while pl.cdiv(m, tm) * pl.cdiv(n, tn) < SMS and max(tm, tn) > MIN_TM:
        if tn >= tm:
            tn //= 2
        else:
            tm //= 2
    return tm, tn


def _load_fp8(ref, mask, k_tail: bool):
    """An e4m3 tile loaded with `mask`. With `k_tail` (K not a multiple of 128), its masked lanes
    are zeroed (their bytes, as int8), since the last block's columns past K enter every output.
    Without, the masked lanes are rows past M or N, whose outputs are not stored: they stay as
    loaded, and the tile goes from the load to the MMA's shared memory unchanged."""
    tile = pltriton.load(ref, mask=mask)
    if not k_tail:
        return tile
    raw = jax.lax.bitcast_convert_type(tile, jnp.int8)
    return jax.lax.bitcast_convert_type(jnp.where(mask, raw, jnp.int8(0)), jnp.float8_e4m3fn)


def _kernel(layer_ref, q_ref, sx_ref, v_ref, sw_ref, o_ref, *, m: int, n: int, k: int, tm: int, tn: int):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows = i * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    outs = j * tn + jax.lax.broadcasted_iota(jnp.int32, (tn, 1), 0)
    scale_row = (j * tn) // BLOCK
    k_tail = k % BLOCK != 0

    def step(kb, acc):
        cols = kb * BLOCK + jax.lax.broadcasted_iota(jnp.int32, (1, BLOCK), 1)
        qx = _load_fp8(q_ref.at[pl.ds(i * tm, tm), pl.ds(kb * BLOCK, BLOCK)], (rows < m) & (cols < k), k_tail)
        qw = _load_fp8(v_ref.at[layer, pl.ds(j * tn, tn), pl.ds(kb * BLOCK, BLOCK)], (outs < n) & (cols < k), k_tail)
        sx = pltriton.load(sx_ref.at[pl.ds(i * tm, tm), pl.ds(kb, 1)], mask=rows < m, other=0.0)
        return acc + _fp8_block_dot.bind(qx, qw) * (sx * sw_ref[layer, scale_row, kb])

    acc = jax.lax.fori_loop(0, pl.cdiv(k, BLOCK), step, jnp.zeros((tm, tn), jnp.float32))
    pltriton.store(o_ref.at[pl.ds(i * tm, tm), pl.ds(j * tn, tn)], acc.astype(o_ref.dtype),
                   mask=(rows < m) & (outs.reshape(1, tn) < n))


def fp8_activation_matmul_gpu(q, s, values, scale, *, out_dtype, layer=None, interpret: bool = False,
                              block_shape: tuple[int, int] | None = None):
    """Quantized activations (q e4m3 `[M, K]`, s float32 `[M, ceil(K/128)]`, from `act_quant`)
    times the FP8 weight (values e4m3 `[N, K]`, scale float32 `[ceil(N/128), ceil(K/128)]`)
    transposed: `[M, N]` in `out_dtype`, accumulated in fp32 block by block (see the module
    doc). With `layer` (an int scalar, may be traced), values and scale are the stacks
    `[L, N, K]` and `[L, ...]` of every layer, of which layer `layer` is read in place (a slice
    of the stack, as a kernel operand, would be a copy). block_shape overrides (TM, TN): powers
    of two, TM >= 64, TN from 16 to 128."""
    if layer is None:  # one layer: a stack of one (a bitcast)
        values, scale = values[None], scale[None]
    m, k = q.shape
    n = values.shape[1]
    blocks = pl.cdiv(k, BLOCK)
    if (q.dtype != jnp.float8_e4m3fn or values.dtype != jnp.float8_e4m3fn or s.shape != (m, blocks)
            or values.shape[2] != k or scale.shape[1:] != (pl.cdiv(n, BLOCK), blocks)):
        raise ValueError(f"fp8_activation_matmul_gpu: q {q.dtype}{list(q.shape)}, s {list(s.shape)}, values "
                         f"{values.dtype}{list(values.shape)}, scale {list(scale.shape)} (needs e4m3 [M, K], "
                         f"[M, ceil(K/128)], e4m3 [L, N, K], [L, ceil(N/128), ceil(K/128)])")
    tm, tn = block_shape or tiles(m, n)
    if any(t & (t - 1) for t in (tm, tn)) or tm < MIN_TM or not MIN_TN <= tn <= BLOCK:
        raise ValueError(f"TM, TN must be powers of two, TM at least {MIN_TM}, TN from {MIN_TN} to {BLOCK}; "
                         f"got {tm}, {tn}")
    grid = (pl.cdiv(m, tm), pl.cdiv(n, tn))
    out_itemsize = jnp.dtype(out_dtype).itemsize
    # HBM bytes: programs launch row tile fastest, so the row tiles of one column tile read its
    # weight together (L2 serves all but the first): the stored weight once; x (values and
    # scales) once when it fits in a quarter of L2 (its column tiles' re-reads come from
    # there), else once per column tile; the output once.
    stored = n * k * values.dtype.itemsize + math.prod(scale.shape[1:]) * scale.dtype.itemsize
    x_bytes = m * k * q.dtype.itemsize + m * blocks * s.dtype.itemsize
    x_reads = 1 if 4 * x_bytes <= L2_BYTES else grid[1]
    cost = pl.CostEstimate(flops=2 * m * n * k, transcendentals=0,
                           bytes_accessed=stored + x_reads * x_bytes + m * n * out_itemsize)
    warps = 8 if tm * tn >= BLOCK * BLOCK else 4
    with declared_cost_scope(cost):
        return pl.pallas_call(
            functools.partial(_kernel, m=m, n=n, k=k, tm=tm, tn=tn),
            grid=grid,
            out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=4 if m <= DECODE_M else 3),
            cost_estimate=cost,
            interpret=interpret,
            name=KERNEL_NAME,
        )(layer_operand(layer), q, s, values, scale)
