"""The lightning indexer's scores over FP8 key records: the Mosaic TPU kernel (also run by the
Pallas interpreter on CPU).

score[b, t, n] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, n]) / sqrt(D), in fp32, the keys k
given as their FP8 records (`kv_record` with no RoPE part: D e4m3 codes, a UE8M0 scale per 64, as
uint32 words `[B, N, W]`), as a cache with `--kv-cache-dtype fp8` holds them.

Why a kernel: XLA decodes the records into a key array in HBM (each key widened to fp32 and rounded
back) before its product reads it again, every ratio-4 layer, growing with the context. Here each
grid step decodes its block of records `[TN, W]` in VMEM (`_decoded`): byte j of code word i, times
its 64-value block's UE8M0 scale, is dim 4 i + j (a "plane" j of the words,
`kv_record.decode_planes`, as the attention kernel decodes records), and four products with 0/1
matrices on the MXU put each plane's values in their dims' columns (exact: every output is one
value, and the values are exact in bf16), so no byte moves between lanes and q needs no re-ordering.
The records are read as stored and nothing else of the keys is written. (Keys as bf16 values stay on
XLA's product, which applies the ReLU, the weights and the head sum as its epilogue and writes only
the scores; a kernel over values moved more bytes in the model's prefill chunk, the queries and
scores re-laid out around it: docs/plan.md.)

Grid: `(B, ceil(N / TN), ceil(T / TT))` or `(B, ceil(T / TT), ceil(N / TN))`, all parallel,
whichever reads fewer bytes: the inner axis's blocks are read once per block of the outer one
(a block whose index does not change between steps is not fetched again), so with the keys
outer every key is read once and the queries once per key block, and the other way round.
A step decodes its keys `[TN, D]`, then for each of its TT tokens multiplies the token's heads
`[H, D]` by them on the MXU, applies the ReLU and the 1 / sqrt(D), and sums the heads weighted
by the token's weights as a `[1, H] x [H, TN]` product in fp32 (HIGHEST precision), writing the
token's `[TN]` scores.
  * TT: T when it is at most TOKEN_BLOCK (the whole axis), else TOKEN_BLOCK (a multiple of 8,
    the scores' sublane tile); TN: N when it is at most KEY_BLOCK, else KEY_BLOCK (a multiple
    of 128, the scores' lane tile). A last partial block reads padding that only reaches the
    scores past T or N, which are not written.

Numerics: decoded values (e4m3 codes times powers of two) are exact in bf16, so bf16 queries
multiply them on the MXU with fp32 accumulation, their products exact in fp32 as in the
reference, which widens both first; fp32 queries multiply at HIGHEST precision. The heads are
summed in the MXU's order, the reference's in XLA's: equal up to fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import kv_record

KERNEL_NAME = "dsv4_indexer_scores"
TOKEN_BLOCK = 128
KEY_BLOCK = 1024
# Fewer keys are padded to this many: a bf16 product with one key fails Mosaic's verifier (it
# becomes a broadcast from bf16 to fp32).
MIN_KEYS = 8


def tiles(t: int, n: int) -> tuple[int, int]:
    """(TT, TN) for T queries and N keys (the module doc)."""
    return (t if t <= TOKEN_BLOCK else TOKEN_BLOCK), (n if n <= KEY_BLOCK else KEY_BLOCK)


def _reads(b: int, t: int, n: int, q_bytes: int, key_bytes: int) -> tuple[bool, int]:
    """(keys outer, HBM bytes of q and the keys) for the cheaper grid order; q_bytes and key_bytes
    per token and per key."""
    tt, tn = tiles(t, n)
    n_t, n_n = pl.cdiv(t, tt), pl.cdiv(n, tn)
    q, k = b * t * q_bytes, b * n * key_bytes
    keys_outer = k + (n_n if n_t > 1 else 1) * q
    q_outer = q + (n_t if n_n > 1 else 1) * k
    return keys_outer <= q_outer, min(keys_outer, q_outer)


def cost_estimate(b: int, t: int, h: int, n: int, d: int, dtype) -> pl.CostEstimate:
    """The declared cost for q of `dtype` and keys of head dim d as records: the MXU's flops (the
    products, the heads' weighted sums and the decode's placing products), and HBM bytes: the
    records and the queries as the grid order reads them (`_reads`), the weights once, the
    scores once."""
    record = kv_record.record_bytes(d, 0)
    tt, _ = tiles(t, n)
    placing = 2 * kv_record.PLANES * (record // 4) * d * pl.cdiv(t, tt)
    _, nbytes = _reads(b, t, n, h * d * jnp.dtype(dtype).itemsize, record)
    return pl.CostEstimate(flops=b * n * (2 * t * h * (d + 1) + placing), transcendentals=0,
                           bytes_accessed=nbytes + b * t * h * 4 + b * t * n * 4)


def _decoded(k_ref, d: int, scales: int):
    """The block of key records (words `[TN, W]`) as its keys, fp32 `[TN, D]`."""
    words = lax.bitcast_convert_type(k_ref[...], jnp.int32)
    quarter = d // kv_record.PLANES  # words of codes
    planes = kv_record.decode_planes(words, quarter, 0, quarter, scales)  # zero past the code words
    word = lax.broadcasted_iota(jnp.int32, (words.shape[1], d), 0)
    dim = lax.broadcasted_iota(jnp.int32, (words.shape[1], d), 1)
    # (precision stated: Mosaic rejects an fp32-precision bf16 product)
    return sum(lax.dot_general(plane.astype(jnp.bfloat16), (dim == kv_record.PLANES * word + j).astype(jnp.bfloat16),
                               (((1,), (0,)), ((), ())), precision=lax.Precision.DEFAULT,
                               preferred_element_type=jnp.float32)
               for j, plane in enumerate(planes))


def _kernel(q_ref, k_ref, w_ref, o_ref, *, scale: float, scales: int, mxu_dtype):
    """q_ref `[TT, H, D]`, k_ref `[TN, W]` record words, w_ref `[TT, H]` fp32, o_ref `[TT, TN]`
    fp32 (scales: the records' scale bytes)."""
    keys = _decoded(k_ref, q_ref.shape[-1], scales).astype(mxu_dtype)
    # Stated, not left to jax_default_matmul_precision: Mosaic rejects an fp32-precision bf16 product.
    precision = lax.Precision.HIGHEST if mxu_dtype == jnp.float32 else lax.Precision.DEFAULT

    @pl.loop(0, q_ref.shape[0])
    def _(t):
        s = lax.dot_general(q_ref[t].astype(mxu_dtype), keys, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # [H, TN]
        r = jnp.maximum(s, 0.0) * jnp.float32(scale)
        o_ref[pl.ds(t, 1), :] = lax.dot_general(w_ref[pl.ds(t, 1), :], r, (((1,), (0,)), ((), ())),
                                                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def indexer_scores_tpu(q, records, weights, *, interpret: bool = False):
    """Same contract as `indexer_scores_ref` of the records' keys as `kv_record.read` decodes them:
    q `[B, T, H, D]` (D a multiple of 4: whole words of codes), records uint32 `[B, N, W]`,
    weights `[B, T, H]` -> fp32 `[B, T, N]`; the Mosaic TPU kernel (interpret=True: the Pallas
    interpreter, any platform)."""
    b, t, h, d = q.shape
    n = records.shape[1]
    if records.shape[0] != b or weights.shape != (b, t, h):
        raise ValueError(f"indexer_scores_tpu: q {q.shape}, records {records.shape} and weights {weights.shape} "
                         "disagree")
    _, scales, size = kv_record.layout(d, 0)
    if records.dtype != jnp.uint32 or records.shape[-1] != size // 4 or d % kv_record.PLANES:
        raise ValueError(f"indexer_scores_tpu: key records of D={d} are uint32 [B, N, {size // 4}] with D a multiple "
                         f"of {kv_record.PLANES}, got {records.dtype} {records.shape}")
    if n == 0:
        return jnp.zeros((b, t, 0), jnp.float32)
    if n < MIN_KEYS:  # zero words decode to zero keys; their scores are dropped
        return indexer_scores_tpu(q, jnp.pad(records, ((0, 0), (0, MIN_KEYS - n), (0, 0))), weights,
                                  interpret=interpret)[..., :n]
    tt, tn = tiles(t, n)
    keys_outer, _ = _reads(b, t, n, h * d * q.dtype.itemsize, size)
    if keys_outer:
        grid = (b, pl.cdiv(n, tn), pl.cdiv(t, tt))
        at = lambda i, k, j: (i, j, k)  # noqa: E731  (batch, token block, key block)
    else:
        grid = (b, pl.cdiv(t, tt), pl.cdiv(n, tn))
        at = lambda i, j, k: (i, j, k)  # noqa: E731
    kernel = functools.partial(_kernel, scale=d ** -0.5, scales=scales,
                               mxu_dtype=jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, tt, h, d), lambda *g: (at(*g)[0], at(*g)[1], 0, 0)),
            pl.BlockSpec((None, tn, records.shape[-1]), lambda *g: (at(*g)[0], at(*g)[2], 0)),
            pl.BlockSpec((None, tt, h), lambda *g: (at(*g)[0], at(*g)[1], 0)),
        ],
        out_specs=pl.BlockSpec((None, tt, tn), lambda *g: at(*g)),
        out_shape=jax.ShapeDtypeStruct((b, t, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        cost_estimate=cost_estimate(b, t, h, n, d, q.dtype),
        interpret=interpret,
        name=KERNEL_NAME,
    )(q, records, weights.astype(jnp.float32))
