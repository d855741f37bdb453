"""Sparse-gather attention with a per-head sink: the Mosaic TPU kernel (also run by the
Pallas interpreter on CPU).

One grid step handles one query token (all H heads at once, so the MXU sees an [H, D] x [D, BK]
product). The token's index row reaches the kernel twice:
  * scalar-prefetched into SMEM (PrefetchScalarGridSpec): the DMA engine needs the row numbers as
    scalars to address the kv rows in HBM;
  * as an ordinary VMEM block [1, K]: a lane vector to mask the logits of padding (-1) keys
    (and, for bf16 kv, to tell each slot's row parity, below).
kv stays in HBM (memory space ANY). For each block of BK keys the kernel starts one DMA per
valid index into a double-buffered VMEM tile [2, BK, D] of 32-bit words; padding slots
are not copied (no HBM traffic) and keep finite data (the tile is zeroed at the start of each
grid step) which gets probability exactly 0. While block i is being used, the
DMAs of block i+1 are in flight. The softmax is online across key blocks, in fp32, with the
running max initialised to the sink logit and the running denominator to exp(sink - sink) = 1,
which folds the sink into the denominator and makes a row with no valid key come out as 0.

Row formats. A DMA moves whole 32-bit words, and TPU keeps a 16-bit array with two consecutive
rows packed into each 32-bit word (in HBM as in VMEM), so a single bf16 row has no address of its
own: Mosaic rejects a one-row copy of it ("Offsets along tiled dimensions must be aligned to
tiles"). So for bf16 kv the kernel views kv as 32-bit words [B, N / 2, D] (the wrapper pads N to
even), fetches word row `row // 2` (the row and its neighbour: twice the row's bytes) and keeps
the slot's own half, exactly: a bf16's fp32 value is its 16 bits on top of 16 zero bits. Other kv
dtypes are fp32 rows (cast to fp32 first unless they are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_K = 128  # keys per block: a full lane width for the [H, BK] logits tile
# Indices scalar-prefetched into SMEM per pallas_call (int32 words). SMEM is small, so a long
# prefill is split into several calls along T; decode (T = 1) is always one call.
MAX_PREFETCH_WORDS = 1 << 15


def _kernel(idx_smem, q_ref, idxv_ref, sink_ref, kv_hbm, o_ref, buf, sem, m_sc, l_sc, acc_sc, *,
            scale: float, n_blocks: int, block_k: int, t_len: int, k_pad: int, pairs: bool, mxu_dtype):
    b = pl.program_id(0)
    t = pl.program_id(1)
    base = (b * t_len + t) * k_pad  # this token's first index in the flat SMEM array
    # With pairs, kv is viewed as 32-bit words [B, N / 2, D]: word row i holds rows 2i and 2i + 1.
    src = kv_hbm.bitcast(jnp.uint32) if pairs else kv_hbm
    shift = 1 if pairs else 0

    def fetch(blk, slot):
        def body(j, carry):
            row = idx_smem[base + blk * block_k + j]

            @pl.when(row >= 0)
            def _():
                pltpu.make_async_copy(src.at[b, pl.ds(row >> shift, 1)], buf.at[slot, pl.ds(j, 1)],
                                      sem.at[slot]).start()

            return carry

        lax.fori_loop(0, block_k, body, 0)

    def wait(blk, slot):
        def body(j, carry):
            row = idx_smem[base + blk * block_k + j]

            @pl.when(row >= 0)
            def _():
                # Any descriptor of the same size waits for one row's bytes on this semaphore.
                pltpu.make_async_copy(src.at[b, pl.ds(0, 1)], buf.at[slot, pl.ds(j, 1)], sem.at[slot]).wait()

            return carry

        lax.fori_loop(0, block_k, body, 0)

    # Padding slots are not copied: they keep finite data (zeros, or an earlier block's rows)
    # and get probability exactly 0.
    buf[...] = jnp.zeros_like(buf)
    m_sc[...] = jnp.broadcast_to(sink_ref[...], m_sc.shape)  # running max starts at the sink
    l_sc[...] = jnp.ones_like(l_sc)  # exp(sink - m) with m = sink
    acc_sc[...] = jnp.zeros_like(acc_sc)
    q = q_ref[...]
    if q.dtype != mxu_dtype:
        q = q.astype(mxu_dtype)
    # Stated, not left to jax_default_matmul_precision: Mosaic rejects an fp32-precision bf16 product.
    precision = lax.Precision.HIGHEST if mxu_dtype == jnp.float32 else lax.Precision.DEFAULT

    fetch(0, 0)

    @pl.loop(0, n_blocks)
    def _(blk):
        slot = blk % 2

        @pl.when(blk + 1 < n_blocks)
        def _():
            fetch(blk + 1, 1 - slot)

        wait(blk, slot)
        idx = idxv_ref[:, pl.ds(pl.multiple_of(blk * block_k, block_k), block_k)]  # [1, BK]
        if pairs:  # each slot's own row out of its word row: the low half for an even row (the
            # packing of Mosaic's bitcast as the Pallas interpreter models it; not seen on a TPU)
            words = buf[slot]  # uint32 [BK, D]
            col = jnp.transpose(jnp.broadcast_to(idx, (8, block_k)))[:, :1]  # the indices as [BK, 1]
            half = jnp.where((col & 1) == 1, words & jnp.uint32(0xFFFF0000), words << 16)
            # A -1 slot's words are stale and may hold an unselected neighbour (NaN is allowed
            # there): zeros, so that p = 0 times the row stays 0.
            rows = pltpu.bitcast(jnp.where(col >= 0, half, jnp.uint32(0)), jnp.float32)
        else:
            rows = buf[slot].astype(jnp.float32)  # [BK, D]
        s = lax.dot_general(q, rows.astype(mxu_dtype), (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [H, BK]
        s = jnp.where(idx >= 0, s, -jnp.inf)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p, rows, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = m_new

    o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)


def _call(q, kv, indices, sink, *, scale: float, interpret: bool, block_k: int):
    bsz, t_len, h, d = q.shape
    k = indices.shape[-1]
    k_pad = pl.cdiv(k, block_k) * block_k
    n_blocks = k_pad // block_k
    indices = indices.astype(jnp.int32)
    if k_pad != k:
        indices = jnp.pad(indices, ((0, 0), (0, 0), (0, k_pad - k)), constant_values=-1)
    pairs = kv.dtype == jnp.bfloat16
    if pairs and kv.shape[1] % 2:  # whole word rows: an even number of rows
        kv = jnp.pad(kv, ((0, 0), (0, 1), (0, 0)))
    elif not pairs and kv.dtype.itemsize != 4:
        kv = kv.astype(jnp.float32)
    mxu_dtype = jnp.bfloat16 if (q.dtype == jnp.bfloat16 and kv.dtype == jnp.bfloat16) else jnp.float32
    kernel = functools.partial(_kernel, scale=float(scale), n_blocks=n_blocks, block_k=block_k,
                               t_len=t_len, k_pad=k_pad, pairs=pairs, mxu_dtype=mxu_dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(bsz, t_len),
        in_specs=[
            pl.BlockSpec((None, None, h, d), lambda b, t, idx: (b, t, 0, 0)),  # q
            pl.BlockSpec((None, 1, k_pad), lambda b, t, idx: (b * t_len + t, 0, 0)),  # index row (VMEM)
            pl.BlockSpec((h, 1), lambda b, t, idx: (0, 0)),  # sink
            pl.BlockSpec(memory_space=pl.ANY),  # kv stays in HBM; rows gathered by DMA
        ],
        out_specs=pl.BlockSpec((None, None, h, d), lambda b, t, idx: (b, t, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, block_k, d), jnp.uint32 if pairs else kv.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, d), jnp.float32),
        ],
    )
    rows_read = bsz * t_len * k * d * 4  # a 32-bit word per element: fp32 rows, or bf16 row pairs
    cost = pl.CostEstimate(flops=4 * bsz * t_len * h * k_pad * d, transcendentals=bsz * t_len * h * k_pad,
                           bytes_accessed=rows_read + 2 * q.size * q.dtype.itemsize + indices.size * 8 + h * 4)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost,
        interpret=interpret,
        name="dsv4_sparse_attention",
    )(indices.reshape(-1), q, indices.reshape(bsz * t_len, 1, k_pad), sink.astype(jnp.float32).reshape(h, 1), kv)


def sparse_attention_tpu(q, kv, indices, sink, *, scale: float, rope_dim: int | None = None,
                         interpret: bool = False, block_k: int = BLOCK_K):
    """Same contract as `sparse_attention_ref`; the Mosaic TPU kernel (interpret=True: the Pallas
    interpreter, any platform)."""
    bsz, t_len, _, _ = q.shape
    k_pad = pl.cdiv(indices.shape[-1], block_k) * block_k
    chunk = max(1, MAX_PREFETCH_WORDS // (bsz * k_pad))
    if t_len <= chunk:
        return _call(q, kv, indices, sink, scale=scale, interpret=interpret, block_k=block_k)
    outs = [_call(q[:, s:s + chunk], kv, indices[:, s:s + chunk], sink, scale=scale, interpret=interpret,
                  block_k=block_k) for s in range(0, t_len, chunk)]
    return jnp.concatenate(outs, axis=1)
