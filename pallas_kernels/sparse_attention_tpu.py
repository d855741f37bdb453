"""Sparse-gather attention with a per-head sink: the Mosaic TPU kernel (also run by the
Pallas interpreter on CPU).

One grid step handles one query token (all H heads at once, so the MXU sees an [H, D] x [D, BK]
product); the grid is (the call's B * T tokens / tokens, tokens), a block of `tokens` consecutive
tokens of all rows sharing one q block and one o block in HBM's token-row layout `[tokens, H * D]`
(`sparse_attention_tpu`), staged as `[tokens, H, D]` in VMEM: the block's first step stages every
token's q, its last writes every token's o. The token's index row reaches the kernel twice:
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

FP8 records (rope_dim given: kv is `kv_record`'s words `[B, N, R / 4]`, 146 for Flash): the kernel
fetches a row's R bytes and decodes them in VMEM, with integer ops and bitcasts (e4m3 codes,
UE8M0 scales, bf16 RoPE halves). Word i holds NoPE dims 4i .. 4i + 3, one per byte, and a RoPE word
two dims, so each byte position j of the words is a "plane" of keys `[BK, R / 4]`: plane j holds
NoPE dim 4i + j in column i, and planes 0 and 1 also the RoPE word's even and odd dim. A product
over D is a sum over dims in any order, so the wrapper lays q out the same way (`_record_columns`:
q's column for each plane and word, zero where a plane has none), the logits are the sum of the
four planes' products and the output comes out as planes, which the wrapper puts back in order:
no byte is moved between lanes in the kernel. Decoded values are e4m3 codes times powers of two
and bf16 RoPE values: exact in bf16, so a bf16 q multiplies them on the MXU in bf16.

Query rotation (query_rope given): q arrives unrotated and the kernel rotates it in VMEM, with
the rounding of the reference's `rotate_heads` (the output stays at the queries' rotation, as
the reference leaves it). Query norm (q_norm_eps given): q arrives before its per-head RMS norm too, and
the kernel scales each head by its unweighted RMS first, rounded as `unweighted_rms_norm` rounds
it (the statistic in fp32, the product in q's dtype): in XLA the norm re-lays the queries out
as the rotation does. The wrapper hands each token its rope as lanes of q's columns (`_rope_lanes`:
cos, and sin signed for the pair's role; 1 and 0 outside the RoPE dims), so a rotation is
x cos + partner(x) sin, a column's partner being the other member of its pair: the lane beside it
in rows, the same column of the other of planes 0 and 1 in records. In XLA the same rotation
of q's last 64 dims of 512 re-lays the queries out with T minor, whole, around it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import kv_record

BLOCK_K = 128  # keys per block: a full lane width for the [H, BK] logits tile
# Indices scalar-prefetched into SMEM per pallas_call (int32 words). SMEM is small, so the B * T
# tokens of a long prefill are split into several calls (each at least one block of tokens).
MAX_PREFETCH_WORDS = 1 << 15
TOKEN_BLOCK = 16  # tokens per q / o block as token rows: the rows of a bf16 (16, 128) tile
PLANES = kv_record.PLANES


class _Rows(NamedTuple):
    """How the kernel reads a fetched block of kv rows (static): "rows" (fp32 rows), "pairs"
    (bf16 row pairs as 32-bit words) or "records" (FP8 records as words); for records, the words
    of the NoPE codes and of the RoPE values, and the first scale word and the scale count."""
    kind: str
    nope_words: int = 0
    rope_words: int = 0
    scale_word: int = 0
    scales: int = 0


def rotated_lanes(x, cos, sin, records: bool = False):
    """x fp32 `[P, H, W]` rotated by its rope lanes cos / sin `[P, 1, W]`: x cos + partner(x) sin."""
    if records:  # planes 0 and 1 hold a pair's even and odd dim in the same column
        partner = jnp.concatenate([x[1:2], x[:1], x[2:]], axis=0)
    else:  # the pair's other dim is the next lane (even) or the previous one (odd)
        rows = x[0]
        lane = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
        n = rows.shape[1]
        # Which of the two lane rotations brings lane i ^ 1 to lane i is read off the rotation of
        # the lane numbers themselves, not assumed from its sign convention.
        from_below = pltpu.roll(lane, 1, 1) == (lane ^ 1)
        partner = jnp.where(from_below, pltpu.roll(rows, 1, 1), pltpu.roll(rows, n - 1, 1))[None]
    return x * cos + partner * sin


def _kernel(idx_smem, q_ref, *refs, scale: float, n_blocks: int, block_k: int, seq_len: int, batch: int, first: int,
            k_pad: int, rows: _Rows, mxu_dtype, rotate: bool, q_norm: tuple[int, float] | None, tokens: int,
            aliased: bool):
    lanes_ref, *refs = refs if rotate else (None, *refs)
    if aliased:  # the output of the call before, taken in place (its tokens are not this call's)
        refs = refs[:3] + refs[4:]
    idxv_ref, sink_ref, kv_hbm, o_ref, buf, sem, m_sc, l_sc, acc_sc, *token_sc = refs
    records = rows.kind == "records"
    r = pl.program_id(1)  # the token within its block of `tokens`
    t = pl.program_id(0) * tokens + r  # within this call's tokens
    # Its sequence (a padding token past the last one reads nothing: its indices are all -1).
    b = jnp.minimum(lax.div(first + t, seq_len), batch - 1)
    base = t * k_pad  # this token's first index in the flat SMEM array
    # With pairs, kv is viewed as 32-bit words [B, N / 2, D]: word row i holds rows 2i and 2i + 1.
    src = kv_hbm.bitcast(jnp.uint32) if rows.kind == "pairs" else kv_hbm
    shift = 1 if rows.kind == "pairs" else 0

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

    def keys(slot, idx):
        """The fetched block as key planes, fp32 `[BK, C]` each (one plane but for records)."""
        col = jnp.transpose(jnp.broadcast_to(idx, (8, block_k)))[:, :1]  # the indices as [BK, 1]
        if rows.kind == "pairs":  # each slot's own row out of its word row: the low half for an even
            # row (the packing of Mosaic's bitcast as the Pallas interpreter models it; not seen on a TPU)
            words = buf[slot]  # uint32 [BK, D]
            half = jnp.where((col & 1) == 1, words & jnp.uint32(0xFFFF0000), words << 16)
            # A -1 slot's words are stale and may hold an unselected neighbour (NaN is allowed
            # there): zeros, so that p = 0 times the row stays 0.
            return [pltpu.bitcast(jnp.where(col >= 0, half, jnp.uint32(0)), jnp.float32)]
        if rows.kind == "records":  # a -1 slot's stale words decode to zeros, as above
            words = jnp.where(col >= 0, lax.bitcast_convert_type(buf[slot], jnp.int32), 0)
            return kv_record.decode_planes(words, rows.nope_words, rows.rope_words, rows.scale_word, rows.scales)
        return [buf[slot].astype(jnp.float32)]  # [BK, D]

    # Padding slots are not copied: they keep finite data (zeros, or an earlier block's rows)
    # and get probability exactly 0.
    buf[...] = jnp.zeros_like(buf)
    m_sc[...] = jnp.broadcast_to(sink_ref[...], m_sc.shape)  # running max starts at the sink
    l_sc[...] = jnp.ones_like(l_sc)  # exp(sink - m) with m = sink
    acc_sc[...] = jnp.zeros_like(acc_sc)
    if token_sc:  # q and o as token rows [tokens, H * C]; a row's heads are staged as [H, C]
        q_sc, o_sc = token_sc
        h, width = q_sc.shape[1:]

        @pl.when(r == 0)
        def _():
            q_sc[...] = q_ref[...].astype(jnp.float32).reshape(tokens, h, width)

        q = q_sc[r][None].astype(q_ref.dtype)  # [1, H, C]: exact, q_sc holds q's values
    else:
        q = q_ref[...]  # [P, H, C]: P planes of q's columns
    if q_norm is not None:  # (d, eps): a head's D values are spread over the planes, zeros elsewhere
        d, eps = q_norm
        qf = q.astype(jnp.float32)
        squares = jnp.sum(jnp.sum(qf * qf, axis=2, keepdims=True), axis=0, keepdims=True)  # [1, H, 1]
        inv_rms = lax.rsqrt(squares / d + eps).astype(q.dtype)
        q = (qf * inv_rms.astype(jnp.float32)).astype(q.dtype)  # q's dtype's product: exact in fp32, rounded once
    if rotate:
        cos, sin = lanes_ref[0][:, None], lanes_ref[1][:, None]  # [P, 1, C]
        q = rotated_lanes(q.astype(jnp.float32), cos, sin, records).astype(q_ref.dtype)
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
        planes = keys(slot, idx)
        s = sum(lax.dot_general(q[i], plane.astype(mxu_dtype), (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) for i, plane in enumerate(planes)) * scale
        s = jnp.where(idx >= 0, s, -jnp.inf)  # [H, BK]
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        for i, plane in enumerate(planes):
            pv = lax.dot_general(p, plane, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
            acc_sc[i] = alpha * acc_sc[i] + pv
        m_sc[...] = m_new

    o = acc_sc[...] / l_sc[...][None]  # [P, H, C]
    if not token_sc:
        o_ref[...] = o.astype(o_ref.dtype)
        return
    o_sc[r] = o[0]

    @pl.when(r == tokens - 1)
    def _():
        o_ref[...] = o_sc[...].reshape(tokens, -1).astype(o_ref.dtype)


def _rope_lanes(query_rope, d: int, record_words: tuple[int, int] | None):
    """The rope of each token as lanes of q's columns, fp32 `[B, T, 2, P, W]`: cos, and sin signed
    for the pair member (-sin on the even dim, +sin on the odd one); 1 and 0 on the other columns.
    For rows `[B, T, 2, 1, D]`, the pairs in neighbouring lanes; for records (record_words: the
    words of NoPE codes and all the words) the PLANES planes' columns, the RoPE words' columns
    holding a pair's even dim in plane 0 and its odd dim in plane 1."""
    cos, sin = query_rope
    bsz, t_len, half = cos.shape

    def const(value, n):
        return jnp.full((bsz, t_len, n), value, jnp.float32)

    if record_words is None:
        planes = [([const(1, d - 2 * half), jnp.repeat(cos, 2, axis=-1)],
                   [const(0, d - 2 * half), jnp.stack([-sin, sin], axis=-1).reshape(bsz, t_len, 2 * half)])]
    else:
        nope_words, words = record_words
        rest = words - nope_words - half
        pairs = [(cos, -sin), (cos, sin)] + [(const(1, half), const(0, half))] * (PLANES - 2)
        planes = [([const(1, nope_words), c, const(1, rest)], [const(0, nope_words), s, const(0, rest)])
                  for c, s in pairs]
    return jnp.stack([jnp.stack([jnp.concatenate(p[i], axis=-1) for p in planes], axis=2) for i in range(2)],
                     axis=2)


def _record_columns(d: int, rope_dim: int) -> np.ndarray:
    """Where each of q's D columns goes in the record planes: int `[PLANES, W]` of column numbers
    (d: none, a zero column), W the record's words."""
    nope, _, size = kv_record.layout(d, rope_dim)
    words = size // PLANES
    cols = np.full((PLANES, words), d, np.int64)
    for j in range(PLANES):
        cols[j, :nope // PLANES] = np.arange(j, nope, PLANES)
    for j in range(2):  # a RoPE word: its even dim in the low half
        cols[j, nope // PLANES: nope // PLANES + rope_dim // 2] = np.arange(nope + j, d, 2)
    return cols


def records_supported(d: int, rope_dim: int) -> bool:
    """Whether the kernel decodes records of this layout itself: whole words of NoPE codes and of
    RoPE values (else the wrapper decodes them before the kernel)."""
    return (d - rope_dim) % PLANES == 0 and rope_dim % 2 == 0


def sparse_attention_tpu(q, kv, indices, sink, query_rope=None, *, scale: float, rope_dim: int | None = None,
                         q_norm_eps: float | None = None, interpret: bool = False, block_k: int = BLOCK_K):
    """Same contract as `sparse_attention_ref`; the Mosaic TPU kernel (interpret=True: the Pallas
    interpreter, any platform). Records of a layout the kernel does not decode (`records_supported`)
    are decoded first.

    The kernel runs over the B * T tokens of all rows, in order. Rows of values take q and give o
    as token rows `[B * T, H * D]` in blocks of TOKEN_BLOCK tokens, laid out as the query
    projection writes them and the output projection reads them (as `[B, T, H, D]` blocks, the
    TPU re-lays the whole queries and output out around the call). Records take q and give o per
    token, as planes (`_record_columns`). Many tokens are split into calls of at most
    MAX_PREFETCH_WORDS indices (at least one block), each reading its tokens of q in place and
    writing its tokens into the one output, which the next call takes over (aliased)."""
    if rope_dim is not None and not records_supported(q.shape[-1], rope_dim):
        kv, rope_dim = kv_record.decode(kv_record.from_words(kv), q.shape[-1], rope_dim, jnp.float32), None
    bsz, t_len, h, d = q.shape
    n = bsz * t_len
    tokens = 1 if rope_dim is not None else min(n, TOKEN_BLOCK)
    padded = pl.cdiv(n, tokens) * tokens
    k = indices.shape[-1]
    k_pad = pl.cdiv(k, block_k) * block_k
    n_blocks = k_pad // block_k
    # whole blocks of tokens (the padding tokens choose no key) and of keys
    indices = jnp.pad(indices.astype(jnp.int32).reshape(n, k), ((0, padded - n), (0, k_pad - k)), constant_values=-1)
    q = jnp.pad(q.reshape(n, h, d), ((0, padded - n), (0, 0), (0, 0)))
    if query_rope is not None:
        query_rope = tuple(jnp.pad(x.reshape(1, n, -1), ((0, 0), (0, padded - n), (0, 0))) for x in query_rope)
    if rope_dim is not None:
        nope, scales, _ = kv_record.layout(d, rope_dim)
        rows = _Rows("records", nope // PLANES, rope_dim // 2, (nope + 2 * rope_dim) // PLANES, scales)
        cols = _record_columns(d, rope_dim)
        qp = jnp.concatenate([q, jnp.zeros((*q.shape[:-1], 1), q.dtype)], axis=-1)[..., cols]  # [N, H, P, W]
        qp = jnp.swapaxes(qp, 1, 2)
        planes, width = qp.shape[1], qp.shape[-1]
        mxu_dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
        token_scratch = []
    else:
        rows = _Rows("pairs" if kv.dtype == jnp.bfloat16 else "rows")
        if rows.kind == "pairs" and kv.shape[1] % 2:  # whole word rows: an even number of rows
            kv = jnp.pad(kv, ((0, 0), (0, 1), (0, 0)))
        elif rows.kind == "rows" and kv.dtype.itemsize != 4:
            kv = kv.astype(jnp.float32)
        qp = q.reshape(padded, h * d)
        planes, width = 1, d
        mxu_dtype = jnp.bfloat16 if (q.dtype == jnp.bfloat16 and kv.dtype == jnp.bfloat16) else jnp.float32
        token_scratch = [pltpu.VMEM((tokens, h, d), jnp.float32), pltpu.VMEM((tokens, h, d), jnp.float32)]

    def token_spec(start):
        """q's and o's blocks in the call from token `start`."""
        if rope_dim is None:
            return pl.BlockSpec((tokens, h * d), lambda t, r, idx: (start // tokens + t, 0))
        return pl.BlockSpec((None, planes, h, width), lambda t, r, idx: (start + t, 0, 0, 0))

    rotate = query_rope is not None
    if rotate and rope_dim is not None and rope_dim != 2 * query_rope[0].shape[-1]:
        raise ValueError(f"query_rope rotates {2 * query_rope[0].shape[-1]} dims but the records hold {rope_dim} "
                         "RoPE dims")
    lanes = [_rope_lanes(query_rope, d, None if rope_dim is None else (rows.nope_words, width))] if rotate else []
    index_rows = indices.reshape(padded, 1, k_pad)
    sink = sink.astype(jnp.float32).reshape(h, 1)
    chunk = max(1, MAX_PREFETCH_WORDS // k_pad // tokens) * tokens  # tokens per call
    out = None
    for start in range(0, padded, chunk):
        length = min(chunk, padded - start)
        kernel = functools.partial(_kernel, scale=float(scale), n_blocks=n_blocks, block_k=block_k, seq_len=t_len,
                                   batch=bsz, first=start, k_pad=k_pad, rows=rows, mxu_dtype=mxu_dtype, rotate=rotate,
                                   q_norm=None if q_norm_eps is None else (d, float(q_norm_eps)), tokens=tokens,
                                   aliased=out is not None)
        def row(t, r):  # the grid step's token (the index maps are traced by this iteration's call)
            return start + t * tokens + r

        lane_specs = [pl.BlockSpec((None, None, 2, planes, width), lambda t, r, idx: (0, row(t, r), 0, 0, 0))
                      ] if rotate else []
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,  # this call's indices, into SMEM
            grid=(length // tokens, tokens),
            in_specs=[
                token_spec(start),  # q
                *lane_specs,  # its rope lanes
                pl.BlockSpec((None, 1, k_pad), lambda t, r, idx: (row(t, r), 0, 0)),  # its index row, in VMEM
                pl.BlockSpec((h, 1), lambda t, r, idx: (0, 0)),  # sink
                pl.BlockSpec(memory_space=pl.ANY),  # kv stays in HBM; rows gathered by DMA
                *([pl.BlockSpec(memory_space=pl.ANY)] if out is not None else []),  # the output so far
            ],
            out_specs=token_spec(start),
            scratch_shapes=[
                pltpu.VMEM((2, block_k, kv.shape[-1]), jnp.uint32 if rows.kind == "pairs" else kv.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((planes, h, width), jnp.float32),
                *token_scratch,
            ],
        )
        # Bytes read per selected row: its record's words, a bf16 row's word pair, an fp32 row.
        cost = pl.CostEstimate(flops=4 * length * h * k_pad * planes * width, transcendentals=length * h * k_pad,
                               bytes_accessed=length * (k * kv.shape[-1] * 4 + 2 * h * d * q.dtype.itemsize + k_pad * 8)
                               + h * 4 + sum(x.size * 4 * length // padded for x in lanes))
        operands = [indices[start:start + length].reshape(-1), qp, *lanes, index_rows, sink, kv]
        out = pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
            input_output_aliases={} if out is None else {len(operands): 0},
            # The tokens of a block share its q and o blocks, so they run in order.
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            cost_estimate=cost,
            interpret=interpret,
            name="dsv4_sparse_attention",
        )(*operands, *([] if out is None else [out]))
    if rope_dim is not None:  # back to q's column order: column c of q was column cols[j, i] = c of plane j
        at = np.full(d, -1, np.int64)
        j, i = np.nonzero(cols < d)
        at[cols[j, i]] = j * width + i
        out = jnp.swapaxes(out, 1, 2).reshape(padded, h, planes * width)[..., at]
    return out[:n].reshape(bsz, t_len, h, d)
