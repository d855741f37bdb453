"""The lightning indexer's scores: the GPU kernel (Hopper, sm_90a), written in Pallas-Triton (also
run by the Pallas interpreter on CPU).

score[b, t, n] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, n]) / sqrt(D), in fp32.

Why a kernel: XLA:GPU computes the products of every key with every query's every head as one
GEMM and writes them out, fp32 `[N, T H]`, before the fusion that applies the ReLU and the
weights and sums the heads reads them back: T H fp32 values per key, written and read again in
every ratio-4 layer, growing with the keys, that is with the context (docs/plan.md has the
bytes). Here each program keeps its products in registers and writes only the scores. (On TPU,
XLA fuses that epilogue into the product itself and writes only the scores, so over keys as
values the reference runs there; over records a TPU kernel decodes them, `indexer_scores_tpu`.)

Keys come as values or as their FP8 records (uint32 words, as a cache with `--kv-cache-dtype
fp8` holds them: `kv_record` with no RoPE part, D e4m3 codes and a UE8M0 scale per 64): the
program loads its tile's code words and scale words and decodes them in registers (byte plane j
of code word c is dim 4 c + j; the planes joined back into dim order as the attention kernel over
records does), so the pool is read as stored and no decoded copy of it is written.

Tiling: grid `(B, ceil(T / TT), ceil(N / TN))`, all parallel. A program loads its key tile
`[TN, D]` once, then for each head loads the query tile's rows of that head `[TT, D]` and that
head's weights `[TT]`, multiplies `[TT, D] x [D, TN]` on the tensor cores, applies the ReLU, the
1 / sqrt(D) and the weights, and adds into an fp32 accumulator `[TT, TN]`; masked loads cover
the tails (rows past T or N, columns past D: D is padded to a power of two, Triton's block
shapes). So every key is read from HBM once; the queries (T H D values) once per key tile, from
L2 after the first when they fit there.
  * TT: T rounded up to a power of two, at least 16 (the MMA's smallest tile), at most 64.
  * TN: 64 (bf16); fp32 operands (small test models) 32, so that the key tile, the products
    and the accumulator stay in registers.

Numerics: bf16 queries and keys multiply on the tensor cores with fp32 accumulation
(`BF16_BF16_F32`): the products of bf16 values are exact in fp32, as in the reference, which
widens both to fp32 first; fp32 operands multiply in IEEE fp32 (not TF32). Decoded record values
are e4m3 codes times powers of two: exact in bf16 and fp32. The heads are
summed in head order, the reference's in XLA's: equal up to fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import kv_record
from ._dispatch import declared_cost_scope
from .quantized_matmul_gpu import L2_BYTES, MIN_ROWS, _pow2_at_least  # the MMA's smallest tile side
from .sparse_attention_fp8_gpu import _e4m3, _join  # the records' decode in registers

KERNEL_NAME = "dsv4_indexer_scores_gpu"
MAX_TT = 64
BF16_TN = 64
FP32_TN = 32


def tiles(t: int, dtype) -> tuple[int, int]:
    """(TT, TN) for T queries of `dtype` (the module doc)."""
    tt = min(_pow2_at_least(t, MIN_ROWS), MAX_TT)
    return tt, (FP32_TN if jnp.dtype(dtype) == jnp.float32 else BF16_TN)


def cost_estimate(b: int, t: int, h: int, n: int, d: int, dtype, key_bytes: int | None = None) -> pl.CostEstimate:
    """The declared cost: the products' flops, and HBM bytes: the keys once (`key_bytes` each: D
    values of dtype, or a record's), the weights and the scores once, the queries once when they
    fit in a quarter of L2 (their re-reads by the other key tiles come from there), else once per
    key tile."""
    itemsize = jnp.dtype(dtype).itemsize
    key_bytes = d * itemsize if key_bytes is None else key_bytes
    q_bytes = b * t * h * d * itemsize
    q_reads = 1 if 4 * q_bytes <= L2_BYTES else pl.cdiv(n, tiles(t, dtype)[1])
    return pl.CostEstimate(flops=2 * b * t * h * n * d, transcendentals=0,
                           bytes_accessed=b * n * key_bytes + q_reads * q_bytes + b * t * h * 4 + b * t * n * 4)


def _kernel(q_ref, k_ref, w_ref, o_ref, *, t: int, n: int, h: int, d: int, dp: int, tt: int, tn: int,
            records: bool):
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32, i32 = jnp.float32, jnp.int32
    rows = i * tt + jax.lax.broadcasted_iota(i32, (tt, 1), 0)
    keys = j * tn + jax.lax.broadcasted_iota(i32, (tn, 1), 0)
    cols = jax.lax.broadcasted_iota(i32, (1, dp), 1)
    # Stated, not left to jax_default_matmul_precision: bf16 products on the tensor cores, fp32
    # ones in IEEE fp32 (the default would be TF32, 10 mantissa bits).
    precision = (jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q_ref.dtype == jnp.bfloat16
                 else jax.lax.Precision.HIGHEST)
    if records:
        k = _decoded(k_ref, b, keys, n, d, dp).astype(q_ref.dtype)
    else:
        k = pltriton.load(k_ref.at[b, pl.ds(j * tn, tn), pl.ds(0, dp)], mask=(keys < n) & (cols < d), other=0)
    scale = f32(d ** -0.5)

    def head(hh, acc):
        q = pltriton.load(q_ref.at[b, pl.ds(i * tt, tt), hh, pl.ds(0, dp)], mask=(rows < t) & (cols < d), other=0)
        w = pltriton.load(w_ref.at[b, pl.ds(i * tt, tt), hh], mask=rows[:, 0] < t, other=0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32)
        return acc + (jnp.maximum(s, 0.0) * scale) * w[:, None]

    acc = jax.lax.fori_loop(0, h, head, jnp.zeros((tt, tn), f32))
    pltriton.store(o_ref.at[b, pl.ds(i * tt, tt), pl.ds(j * tn, tn)], acc,
                   mask=(rows < t) & (keys.reshape(1, tn) < n))


def _decoded(k_ref, b, keys, n: int, d: int, dp: int):
    """The key tile `[TN, dp]` (fp32, zero past D and past N) of the FP8 key records (`kv_record`
    with no RoPE dims: D e4m3 codes, then a UE8M0 scale byte per 64) as uint32 words `[B, N, W]`:
    byte plane j of code word c holds dim 4 c + j, scaled by its block's (4 c / 64) scale byte;
    the planes are interleaved back into dim order as the attention kernel over records does."""
    i32 = jnp.int32
    words_total = k_ref.shape[-1]
    word = jax.lax.iota(i32, dp // 4)
    scale_byte = d + word // 16  # byte offset of code word c's scale: its 64-dim block's
    row = jnp.minimum(keys, n - 1)
    ok = (keys < n) & (word < d // 4)[None, :]

    def gather(at):  # the tile's words at columns `at` `[dp / 4]`, as int32 (masked: zero words)
        w = pltriton.load(k_ref.at[b, row, jnp.minimum(at, words_total - 1)[None, :]], mask=ok, other=0)
        return jax.lax.bitcast_convert_type(w, i32)

    codes, scales = gather(word), gather(scale_byte // 4)
    scale = jax.lax.bitcast_convert_type(((scales >> ((scale_byte % 4) * 8)[None, :]) & 0xFF) << 23, jnp.float32)
    planes = [_e4m3((codes >> (8 * p)) & 0xFF, scale) for p in range(4)]
    return _join(_join(planes[0], planes[2]), _join(planes[1], planes[3]))


def indexer_scores_gpu(q, keys, weights, *, interpret: bool = False):
    """q `[B, T, H, D]` (bf16 or fp32), keys `[B, N, D]` of q's dtype or FP8 key records (uint32
    words `[B, N, W]`, `kv_record.to_words` of `kv_record.encode(keys, 0)`; D a multiple of 4),
    weights `[B, T, H]` -> scores fp32 `[B, T, N]`, the semantics of `indexer_scores_ref` (of the
    decoded keys, for records). interpret: run in the Pallas interpreter (CPU)."""
    B, T, H, D = q.shape
    N = keys.shape[1]
    records = keys.dtype == jnp.uint32
    width = kv_record.record_bytes(D, 0) // 4 if records else D
    if keys.shape != (B, N, width) or weights.shape != (B, T, H) or (records and D % 4):
        raise ValueError(f"indexer_scores_gpu: q {tuple(q.shape)}, keys {tuple(keys.shape)} and weights "
                         f"{tuple(weights.shape)} need [B, T, H, D], [B, N, D] (records: [B, N, "
                         f"{width}] words, D a multiple of 4) and [B, T, H]")
    if q.dtype not in (jnp.bfloat16, jnp.float32) or not (records or keys.dtype == q.dtype):
        raise ValueError(f"indexer_scores_gpu: q and keys must be both bfloat16 or both float32 (or keys FP8 "
                         f"records), got {q.dtype} and {keys.dtype}")
    if N == 0 or T == 0:
        return jnp.zeros((B, T, N), jnp.float32)
    tt, tn = tiles(T, q.dtype)
    dp = 4 * _pow2_at_least(D // 4, MIN_ROWS // 4) if records else _pow2_at_least(D, MIN_ROWS)
    kernel = functools.partial(_kernel, t=T, n=N, h=H, d=D, dp=dp, tt=tt, tn=tn, records=records)
    cost = cost_estimate(B, T, H, N, D, q.dtype, keys.dtype.itemsize * width)
    with declared_cost_scope(cost):
        return pl.pallas_call(
            kernel,
            grid=(B, pl.cdiv(T, tt), pl.cdiv(N, tn)),
            out_shape=jax.ShapeDtypeStruct((B, T, N), jnp.float32),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            cost_estimate=cost,
            interpret=interpret,
            name=KERNEL_NAME,
        )(q, keys, weights.astype(jnp.float32))
