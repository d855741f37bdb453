"""Sparse-gather attention over DeepSeek-V4's FP8 KV records: the GPU kernel (Hopper, sm_90a),
written in Pallas-Triton (also run by the Pallas interpreter on CPU). It gathers the record rows
its index row selects straight from the cache's words and decodes them in registers: no XLA
decode of the cache (the reference's way) comes before it.

Operands as `sparse_attention_ref(..., rope_dim=...)` takes them: q `[B, T, H, D]` (bf16 or fp32),
the records as uint32 words `[B, N, W]` (`kv_record.to_words`: W = R / 4, 146 for Flash's 584-byte
records), indices int32 `[B, T, K]` (-1: no key), sink fp32 `[H]`; the result `[B, T, H, D]` in
q's dtype.

Why Pallas-Triton and not Mosaic GPU (the non-record kernel, sparse_attention_mgpu.py): Mosaic
GPU moves GMEM to SMEM by TMA, whose global strides must be multiples of 16 bytes; a record row
is 584 bytes (8-byte aligned). Compiled for sm_90a (jax 0.10.2), copying one `[1, 146]` uint32
row refuses with "Only copies transferring a number of bytes divisible by the warpgroup size are
supported. Got bytes=584", and a flat-word view copied as `[160]` words refuses with "must have a
number of elements that is a multiple of 128". In Triton a load from computed row addresses is an
ordinary (masked) gather of 4-byte words, the decode is elementwise integer code on the loaded
tile, and the products go to the tensor cores through `dot` with no hand-made SMEM layout.

Grid: one program per (token, group of HB = 16 heads), flattened to 1-D with the head groups of
a token adjacent (they gather the same rows: the later ones find them in L2). 16 is the MMA's
smallest M; heads past H are masked (no padding copy of q). At Flash decode (sm_90a, 8 warps,
BK 32, 2 stages) ptxas gives 247 registers a thread and no spills with HB 16, while HB 32 spills
844 bytes a thread and HB 64 5.6 KB; 4 warps at BK 16 spill 36 bytes. The PTX holds
`mma.sync m16n8k16` bf16 products (wgmma wants 64-row tiles) and `cp.async` gathers of the
words (Triton pipelines the gathered loads). A program loops over its token's K indices in
blocks of BK (masked past K) and per block:
  * gathers the BK selected records' words (`[BK, NW]` NoPE words, `[BK, RW]` RoPE words, and one
    scale word per NoPE word; widths padded to powers of two, masked: rows whose index is -1 or
    past K load nothing and read as zero words, so garbage in unselected or padded rows never
    reaches the sums);
  * decodes: byte j of NoPE word i is e4m3 code of dim 4i + j (block (4i) / 64's UE8M0 scale):
    value = code's magnitude bits shifted into a float32 (exponent + 120: bias 127 - 7) or, for
    exponent 0, mantissa * 2^-9; times 2^(scale byte - 127); signed. The four byte planes are
    interleaved into dim order with two levels of Triton joins (stack on the last axis + reshape),
    so q's NoPE columns load as they are. RoPE word m's low half is dim 2m, its high half dim
    2m + 1 (`bitcast(w << 16)`, `bitcast(w & 0xFFFF0000)`), joined likewise. Decoded values are
    e4m3 times a power of two: exact in bf16 and fp32.
  * logits `[HB, BK]` = q_nope . V_nope^T + q_rope . V_rope^T (two dots), times scale, -inf on
    invalid slots; online softmax in fp32 (running max starts at the sink, denominator at 1, so
    the sink only enters the denominator and a row without valid keys gives 0);
  * acc `[HB, nope padded]` and `[HB, rope padded]` (fp32) += p . V.
Products: every dot is a bf16 tensor-core dot with fp32 accumulation, the decoded rows being one
operand (exact in bf16). The other operand is split into bf16 pieces that sum to it (`_split`):
bf16 q is one piece (its logits' products are exact), fp32 q three (~24 bits: fp32's); p is
two pieces for bf16 q (~16 bits, not bf16's 8) and three for fp32 q. So against the reference
the output differs by fp32 summation order (and for bf16 the one final rounding), not by a
rounding of p or of fp32 q to bf16. Splitting costs MMA work only, which decode does not lack
(it is bound by the gathered bytes); an fp32 IEEE dot (Precision.HIGHEST, CUDA cores) was tried
first for fp32 q and spilled 10.9 KB a thread at Flash decode.

Supported: q bf16 or fp32, nope = D - rope_dim a positive multiple of 4 (every word is all NoPE
or all RoPE; a last partial scale block is fine) and rope_dim even, 0 included (DeepSeek-V4:
D 512, rope 64; any H >= 1, K >= 1, any N). Anything else (and H = 0 or K = 0) falls back to the
reference, never raising: the dispatcher traces the CUDA branch on every platform.

Declared cost (`declared_cost_scope`, as the other Pallas-Triton kernels: the Triton lowering
drops `pl.CostEstimate`): bytes = each selected record once per token (K * R, the head groups'
re-reads served by L2), q, indices and the output; flops 4 * H * K * D per token (logits and
weighted sum); transcendentals H * K per token.

Not done: splitting K over programs (flash-decoding). At decode with a small batch the grid is
B * ceil(H / HB) programs, fewer than an H100's 132 SMs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from . import kv_record
from ._dispatch import declared_cost_scope
from .sparse_attention_ref import sparse_attention_ref

KERNEL_NAME = "dsv4_sparse_attention_fp8"
MIN_DOT = 16  # Triton's smallest dot dimension
HEADS = 16  # heads per program (HB): the MMA's smallest M; 32 spills (module doc)
BLOCK_K = 32  # keys per block (16 when K <= 16)
NUM_WARPS = 8
NUM_STAGES = 2


def _pow2(v: int, lo: int = 1) -> int:
    return max(lo, 1 << max(v - 1, 0).bit_length())


def supported(q_dtype, h: int, d: int, k: int, rope_dim: int) -> bool:
    nope = d - rope_dim
    return (jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) and h >= 1 and k >= 1
            and rope_dim >= 0 and rope_dim % 2 == 0 and nope > 0 and nope % 4 == 0)


def _padded(nope: int, rope: int) -> tuple[int, int]:
    """The NoPE and RoPE column widths a program computes: powers of two, at least 16 (dot)."""
    return 4 * _pow2(nope // 4, MIN_DOT // 4), 2 * _pow2(rope // 2, MIN_DOT // 2)


def _out_shape(bt: int, h: int, hb: int, nope: int, rope: int) -> tuple[int, int, int]:
    """The kernel's output `[BT, H, D]`, padded to whole head groups and the computed columns."""
    dn, dr = _padded(nope, rope)
    return bt, pl.cdiv(h, hb) * hb, max(dn, nope + dr)


def _split(x, n: int) -> list:
    """x (bf16 or fp32) -> n bf16 pieces summing to x within ~2^(-8 n) relative (bf16 x, n = 1: x)."""
    if n == 1 and x.dtype == jnp.bfloat16:
        return [x]
    rest, pieces = x.astype(jnp.float32), []
    for _ in range(n):
        pieces.append(rest.astype(jnp.bfloat16))
        rest = rest - pieces[-1].astype(jnp.float32)
    return pieces


def _e4m3(code, scale):
    """int32 codes (0..255) and float32 scales -> float32 values code * scale."""
    mag = code & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    sub = (mag & 7).astype(jnp.float32) * jnp.float32(2.0 ** -9)
    v = jnp.where(mag < 8, sub, normal) * scale
    return jnp.where(code >= 128, -v, v)


def _join(a, b):
    """[R, C] and [R, C] -> [R, 2C], interleaved: column 2c from a, 2c + 1 from b."""
    r, c = a.shape
    return jnp.stack([a, b], axis=-1).reshape(r, 2 * c)


def dsv4_sparse_attention_fp8(idx_ref, q_ref, kv_ref, sink_ref, o_ref, *, scale: float, t_len: int, h: int,
                              groups: int, hb: int, bk: int, k: int, nope: int, rope: int):
    """One (token, head group) program; Triton names the kernel after this function."""
    f32, i32 = jnp.float32, jnp.int32
    d = nope + rope
    w_total = kv_ref.shape[-1]
    pid = pl.program_id(0)
    bt, g = pid // groups, pid % groups
    b = bt // t_len
    nw, rw = nope // 4, rope // 2  # NoPE / RoPE words of a record
    dn, dr = _padded(nope, rope)
    nwp, rwp = dn // 4, dr // 2
    s0 = nope + 2 * rope  # byte offset of the scales

    heads = g * hb + jax.lax.iota(i32, hb)
    hmask = heads < h
    hc = jnp.minimum(heads, h - 1)
    ncols = jax.lax.iota(i32, dn)
    rcols = nope + jax.lax.iota(i32, dr)
    nmask = hmask[:, None] & (ncols < nope)[None, :]
    rmask = hmask[:, None] & (rcols < d)[None, :]
    q_nope = pltr.load(q_ref.at[bt, hc[:, None], jnp.minimum(ncols, d - 1)[None, :]], mask=nmask, other=0)
    q_rope = pltr.load(q_ref.at[bt, hc[:, None], jnp.minimum(rcols, d - 1)[None, :]], mask=rmask, other=0)
    sink = pltr.load(sink_ref.at[hc], mask=hmask, other=0).astype(f32)
    # Every product is a bf16 tensor-core dot with fp32 accumulation (the decoded values are exact
    # in bf16); the other operand is split into bf16 pieces: q bf16 1, fp32 3; p 2, fp32 q 3.
    fp32 = q_ref.dtype == jnp.float32
    q_nope = _split(q_nope, 3 if fp32 else 1)
    q_rope = _split(q_rope, 3 if fp32 else 1)

    def logits(qs, v):  # [HB, C] pieces . [BK, C]^T -> [HB, BK]
        return sum(jax.lax.dot_general(a, v, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.DEFAULT,
                                       preferred_element_type=f32) for a in qs)

    def weighted(ps, v):  # [HB, BK] pieces . [BK, C] -> [HB, C]
        return sum(jax.lax.dot_general(a, v, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.DEFAULT,
                                       preferred_element_type=f32) for a in ps)

    nword = jax.lax.iota(i32, nwp)
    rword = jax.lax.iota(i32, rwp)
    sword = (s0 + nword // 16) // 4  # the word holding NoPE word i's scale byte
    sshift = ((s0 + nword // 16) % 4) * 8
    nword_ok = (nword < nw)[None, :]
    rword_ok = (rword < rw)[None, :]
    nword_c = jnp.minimum(nword, w_total - 1)[None, :]
    rword_c = jnp.minimum(nw + rword, w_total - 1)[None, :]
    sword_c = jnp.minimum(sword, w_total - 1)[None, :]

    def block(kb, carry):
        m, l, acc_n, acc_r = carry
        slots = kb * bk + jax.lax.iota(i32, bk)
        row = pltr.load(idx_ref.at[bt, jnp.minimum(slots, k - 1)], mask=slots < k, other=-1)
        valid = row >= 0
        rows = jnp.where(valid, row, 0)[:, None]
        vmask = valid[:, None]

        def gather(cols, ok):  # the selected rows' words at cols, as int32 (masked: zero words)
            w = pltr.load(kv_ref.at[b, rows, cols], mask=vmask & ok, other=0)
            return jax.lax.bitcast_convert_type(w, i32)

        words = gather(nword_c, nword_ok)
        sbytes = gather(sword_c, nword_ok)
        rwords = gather(rword_c, rword_ok)
        sc = jax.lax.bitcast_convert_type(((sbytes >> sshift[None, :]) & 0xFF) << 23, f32)
        planes = [_e4m3((words >> (8 * j)) & 0xFF, sc) for j in range(4)]
        # Byte plane j holds dims 4i + j: joined (0, 2) and (1, 3), then those two.
        v_nope = _join(_join(planes[0], planes[2]), _join(planes[1], planes[3])).astype(jnp.bfloat16)
        even = jax.lax.bitcast_convert_type(rwords << 16, f32)
        odd = jax.lax.bitcast_convert_type(rwords & jnp.int32(-65536), f32)
        v_rope = _join(even, odd).astype(jnp.bfloat16)

        s = (logits(q_nope, v_nope) + logits(q_rope, v_rope)) * scale
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        ps = _split(p, 3 if fp32 else 2)
        acc_n = alpha[:, None] * acc_n + weighted(ps, v_nope)
        acc_r = alpha[:, None] * acc_r + weighted(ps, v_rope)
        return m_new, l, acc_n, acc_r

    init = (sink, jnp.ones((hb,), f32), jnp.zeros((hb, dn), f32), jnp.zeros((hb, dr), f32))
    _, l, acc_n, acc_r = jax.lax.fori_loop(0, pl.cdiv(k, bk), block, init)
    # The output is padded to whole head groups and to the padded columns (`_out_shape`), so the
    # stores need no clamped (duplicate) addresses: the interpreter's masked store writes back
    # what it read at masked lanes, and a duplicate address could write a stale value last.
    pltr.store(o_ref.at[bt, heads[:, None], ncols[None, :]], (acc_n / l[:, None]).astype(o_ref.dtype),
               mask=nmask)
    pltr.store(o_ref.at[bt, heads[:, None], rcols[None, :]], (acc_r / l[:, None]).astype(o_ref.dtype),
               mask=rmask)


def cost_estimate(bt: int, h: int, d: int, k: int, rope_dim: int, q_itemsize: int) -> pl.CostEstimate:
    """Each selected record once per token, q, the indices and the output (HBM bytes)."""
    rec = kv_record.record_bytes(d, rope_dim)
    return pl.CostEstimate(flops=4 * bt * h * k * d, transcendentals=bt * h * k,
                           bytes_accessed=bt * (k * rec + 4 * k + 2 * h * d * q_itemsize) + 4 * h)


def tiles(k: int) -> tuple[int, int]:
    """(HB, BK): heads per program and keys per block."""
    return HEADS, BLOCK_K if k > MIN_DOT else MIN_DOT


def sparse_attention_fp8_gpu(q, kv, indices, sink, *, scale: float, rope_dim: int, interpret: bool = False,
                             block_k: int | None = None, heads_per_program: int | None = None):
    """Same contract as `sparse_attention_ref(..., rope_dim=rope_dim)`: kv the records' uint32
    words `[B, N, W]`. The Pallas-Triton kernel where `supported`, the reference otherwise."""
    bsz, t_len, h, d = q.shape
    k = indices.shape[-1]
    if not supported(q.dtype, h, d, k, rope_dim):
        return sparse_attention_ref(q, kv, indices, sink, scale=scale, rope_dim=rope_dim)
    hb, bk = tiles(k)
    hb, bk = heads_per_program or hb, block_k or bk
    groups = pl.cdiv(h, hb)
    bt = bsz * t_len
    cost = cost_estimate(bt, h, d, k, rope_dim, q.dtype.itemsize)
    out_shape = _out_shape(bt, h, hb, d - rope_dim, rope_dim)
    kernel = functools.partial(dsv4_sparse_attention_fp8, scale=float(scale), t_len=t_len, h=h, groups=groups,
                               hb=hb, bk=bk, k=k, nope=d - rope_dim, rope=rope_dim)
    with declared_cost_scope(cost):
        out = pl.pallas_call(
            kernel,
            grid=(bt * groups,),
            out_shape=jax.ShapeDtypeStruct(out_shape, q.dtype),
            compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
            cost_estimate=cost,
            interpret=interpret,
            name=KERNEL_NAME,
        )(indices.astype(jnp.int32).reshape(bt, k), q.reshape(bt, h, d), kv, sink.astype(jnp.float32))
    if out_shape != (bt, h, d):  # not at DeepSeek-V4's shapes (H a multiple of HB, D 512, rope 64)
        out = out[:, :h, :d]
    return out.reshape(bsz, t_len, h, d)
