"""The Pallas kernels (TPU kernel bodies, run by the Pallas interpreter on CPU) against the
plain-JAX references, on random inputs.

Tolerances:
* fp32 inputs / outputs: max |kernel - ref| <= 1e-5 * max |ref|. Both compute in fp32; they differ
  only in the order of the sums (online softmax across key blocks, the pooling written as
  sum(a * e / s) in a different association), which costs a few fp32 ulps.
* bf16 outputs: max |kernel - ref| <= 2^-6 * max |ref|, and fewer than 1% of the elements differ.
  The fp32 internals agree to ~1e-6, but the result (and, in the compressor, the pooled value
  before the norm) is rounded to bf16, whose ulp is 2^-7 relative at worst. A last-bit difference
  in fp32 can flip one rounding (1 ulp), and in the compressor a flip of the pooled value
  propagates through the norm and the rope pair mix into a second rounding: 2 ulps of the largest
  values, i.e. 2^-6 of max |ref|. The mismatch fraction guards against systematic errors hiding
  inside that bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import compress, compress_ref, kv_record
from pallas_kernels import sparse_attention, sparse_attention_ref
from pallas_kernels import sparse_attention_tpu as sat
from pallas_kernels.compressor_tpu import compress_tpu
from pallas_kernels.numerics import rotate_heads, unweighted_rms_norm
from dsv4_jax.model.config import Yarn
from dsv4_jax.model.rope import cos_sin, inv_freq


def _check(out, ref):
    out = np.asarray(out.astype(jnp.float32))
    ref_ = np.asarray(ref.astype(jnp.float32))
    assert out.shape == ref_.shape and out.dtype == ref_.dtype
    scale = max(np.abs(ref_).max(), 1e-30)
    err = np.abs(out - ref_).max()
    if ref.dtype == jnp.float32:
        assert err <= 1e-5 * scale, (err, scale)
    else:
        assert err <= 2.0 ** -6 * scale, (err, scale)
        assert np.mean(out != ref_) < 0.01


# ----------------------------------------------------------------------------- sparse attention

def _attention_inputs(b, t, h, d, n, k, dtype, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(dtype)
    kv = (2 * jax.random.normal(ks[1], (b, n, d), jnp.float32)).astype(dtype)
    # Random rows in [-1, n): -1 padding, and duplicates since k > n or by chance.
    idx = jax.random.randint(ks[2], (b, t, k), -1, n).astype(jnp.int32)
    idx = idx.at[0, 0].set(-1)  # a row with no valid key
    if t > 1:  # a window-like row: the first keys valid, the rest padding, one key repeated
        row = jnp.where(jnp.arange(k) < k // 3, jnp.arange(k) % n, -1).at[1].set(0)
        idx = idx.at[-1, 1].set(row.astype(jnp.int32))
    sink = jax.random.normal(ks[3], (h,), jnp.float32)
    return q, kv, idx, sink


@pytest.mark.parametrize(
    "b, t, h, d, n, k, dtype",
    [
        (2, 3, 8, 128, 50, 200, jnp.float32),  # prefill, 2 key blocks (K padded 200 -> 256), duplicates
        (2, 1, 16, 512, 300, 160, jnp.bfloat16),  # decode, D = 512
        (1, 1, 8, 512, 40, 96, jnp.float32),  # decode, D = 512, one partial block
        (1, 4, 8, 256, 64, 130, jnp.bfloat16),  # prefill bf16
        (1, 2, 8, 128, 41, 100, jnp.bfloat16),  # bf16 kv with an odd row count (the TPU kernel pads a row)
    ],
)
def test_sparse_attention_matches_ref(b, t, h, d, n, k, dtype):
    q, kv, idx, sink = _attention_inputs(b, t, h, d, n, k, dtype, seed=b * 100 + t * 10 + k)
    scale = d ** -0.5
    out = sparse_attention(q, kv, idx, sink, scale=scale, impl="pallas")
    ref = sparse_attention_ref(q, kv, idx, sink, scale=scale)
    assert out.dtype == q.dtype
    _check(out, ref)
    assert np.all(np.asarray(out[0, 0].astype(jnp.float32)) == 0.0)  # the row with no valid key


def test_sparse_attention_all_invalid_and_duplicates():
    q, kv, idx, sink = _attention_inputs(1, 2, 8, 128, 20, 64, jnp.float32, seed=7)
    idx = idx.at[0, 0].set(-1).at[0, 1].set(jnp.full((64,), 3, jnp.int32).at[5:].set(-1))
    out = sparse_attention(q, kv, idx, sink, scale=0.1, impl="pallas")
    _check(out, sparse_attention_ref(q, kv, idx, sink, scale=0.1))
    assert np.all(np.asarray(out[0, 0]) == 0.0)
    # Five copies of one key: o = 5 e^l kv / (5 e^l + e^sink).
    logit = 0.1 * np.einsum("hd,d->h", np.asarray(q[0, 1]), np.asarray(kv[0, 3]))
    w = 5 * np.exp(logit) / (5 * np.exp(logit) + np.exp(np.asarray(sink)))
    np.testing.assert_allclose(np.asarray(out[0, 1]), w[:, None] * np.asarray(kv[0, 3])[None], rtol=1e-5, atol=1e-6)


def test_sparse_attention_unselected_rows_do_not_leak():
    # bf16 rows travel in pairs on TPU (a row and its neighbour): NaN in rows nobody selects (odd
    # rows here), fetched beside selected ones, must not reach the output, and neither may a
    # -1 slot whose buffer still holds an earlier block's pair.
    q, kv, _, sink = _attention_inputs(1, 2, 8, 128, 64, 384, jnp.bfloat16, seed=11)
    kv = kv.at[:, 1::2].set(jnp.nan)
    even, slots = (2 * jnp.arange(384, dtype=jnp.int32)) % 64, jnp.arange(384)
    # token 0: key block 0 full, blocks 1-2 all -1 (block 2 reuses block 0's buffer); token 1: mixed
    idx = jnp.stack([jnp.where(slots < 128, even, -1), jnp.where(slots % 3 == 0, even, -1)])[None]
    out = sparse_attention(q, kv, idx, sink, scale=0.1, impl="pallas")
    _check(out, sparse_attention_ref(q, kv, idx, sink, scale=0.1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_attention_chunked_prefill(dtype, monkeypatch):
    # A prefill long enough to exceed the SMEM prefetch budget is split into calls, each of whole
    # blocks of TOKEN_BLOCK tokens (40 tokens: padded to 48, calls of 32 and 16), each writing its
    # tokens into the output the call before wrote.
    monkeypatch.setattr(sat, "MAX_PREFETCH_WORDS", 2 * sat.TOKEN_BLOCK * 128)
    q, kv, idx, sink = _attention_inputs(1, 40, 2, 128, 30, 100, dtype, seed=3)
    calls, pallas_call = [], sat.pl.pallas_call
    monkeypatch.setattr(sat.pl, "pallas_call", lambda *a, **kw: calls.append(kw["grid_spec"].grid) or
                        pallas_call(*a, **kw))
    out = sat.sparse_attention_tpu(q, kv, idx, sink, scale=0.2, interpret=True)
    assert calls == [(2, sat.TOKEN_BLOCK), (1, sat.TOKEN_BLOCK)]
    assert out.shape == q.shape and out.dtype == dtype
    _check(out, sparse_attention_ref(q, kv, idx, sink, scale=0.2))


def _query_rope(b, t, rope, seed):
    """cos, sin fp32 `[b, t, rope / 2]` at random positions up to 1e6 (Flash's compressed-layer
    frequencies, YaRN included)."""
    pos = jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, 1_000_000)
    return cos_sin(pos, jnp.asarray(inv_freq(rope, 160000.0, Yarn(16.0, 65536, 32.0, 1.0))))


@pytest.mark.parametrize(
    "b, t, h, d, rope, n, k, dtype, records, prefetch_words",
    [
        (2, 3, 8, 128, 64, 50, 200, jnp.float32, False, None),  # fp32 rows, 2 key blocks
        (1, 4, 16, 512, 64, 300, 160, jnp.bfloat16, False, None),  # bf16 row pairs, Flash's D and rope
        (2, 20, 8, 128, 32, 30, 100, jnp.float32, False, 2 * 16 * 128),  # 2 calls, blocks across rows, padding
        (2, 2, 8, 512, 64, 60, 130, jnp.bfloat16, True, None),  # Flash's 584-byte records
        (1, 3, 8, 128, 32, 40, 100, jnp.float32, True, None),  # records, fp32 queries
        (2, 2, 8, 128, 32, 40, 100, jnp.float32, True, 128),  # records, a call per token
    ],
)
def test_sparse_attention_rotates_queries(b, t, h, d, rope, n, k, dtype, records, prefetch_words, monkeypatch):
    """With query_rope the TPU kernel takes q unrotated and rotates it in VMEM (the output stays at
    the queries' rotation): against the reference (which rotates q in XLA) to the tolerances
    above, and against the kernel itself called on q rotated in XLA: equal in bf16 (the same
    products of the same rounded q), and to 1e-6 of max |out| in fp32, where XLA:CPU may
    contract a rotation's product and sum into one fused multiply-add inside its fusions and the
    kernel's interpreted ops do not."""
    if prefetch_words:
        monkeypatch.setattr(sat, "MAX_PREFETCH_WORDS", prefetch_words)
    seed = d + k + t
    q, kv, idx, sink = (_record_inputs(b, t, h, d, rope, n, k, dtype, seed) if records
                        else _attention_inputs(b, t, h, d, n, k, dtype, seed))
    query_rope = _query_rope(b, t, rope, seed)
    kw = dict(scale=d ** -0.5, rope_dim=rope if records else None)
    out = sparse_attention(q, kv, idx, sink, query_rope, impl="pallas", **kw)
    ref = sparse_attention_ref(q, kv, idx, sink, query_rope, **kw)
    assert out.dtype == q.dtype
    _check(out, ref)
    unrotated = np.asarray(sparse_attention_ref(q, kv, idx, sink, **kw).astype(jnp.float32))
    assert np.abs(np.asarray(ref.astype(jnp.float32)) - unrotated).max() > 0.1 * np.abs(unrotated).max()
    around = sparse_attention(rotate_heads(q, query_rope), kv, idx, sink, impl="pallas", **kw)
    out, around = (np.asarray(x.astype(jnp.float32)) for x in (out, around))
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(out, around)
    else:
        assert np.abs(out - around).max() <= 1e-6 * np.abs(around).max()


@pytest.mark.parametrize(
    "b, t, h, d, rope, n, k, dtype, records",
    [
        (2, 3, 8, 128, 64, 50, 200, jnp.float32, False),  # fp32 rows
        (1, 4, 16, 512, 64, 300, 160, jnp.bfloat16, False),  # bf16 row pairs, Flash's D and rope
        (2, 2, 8, 512, 64, 60, 130, jnp.bfloat16, True),  # Flash's 584-byte records: q in planes
    ],
)
def test_sparse_attention_normalizes_queries(b, t, h, d, rope, n, k, dtype, records):
    """With q_norm_eps the TPU kernel takes q before its per-head RMS norm too (heads scaled by
    0.05 to 40, so the norm matters) and scales it in VMEM: against the reference (which
    normalizes in XLA) to the tolerances above, and against the kernel called on q normalized in
    XLA (`unweighted_rms_norm`): equal in bf16 (the statistic may differ in its last fp32 bit, the
    bf16 factor it rounds to does not here), to 1e-5 of max |out| in fp32."""
    seed = d + k + t
    q, kv, idx, sink = (_record_inputs(b, t, h, d, rope, n, k, dtype, seed) if records
                        else _attention_inputs(b, t, h, d, n, k, dtype, seed))
    gain = np.random.default_rng(seed).uniform(0.05, 40, (b, t, h, 1))
    raw = (q.astype(jnp.float32) * gain).astype(dtype)
    query_rope = _query_rope(b, t, rope, seed)
    kw = dict(scale=d ** -0.5, rope_dim=rope if records else None)
    out = sparse_attention(raw, kv, idx, sink, query_rope, impl="pallas", q_norm_eps=1e-6, **kw)
    _check(out, sparse_attention_ref(raw, kv, idx, sink, query_rope, q_norm_eps=1e-6, **kw))
    pre = sparse_attention(unweighted_rms_norm(raw, 1e-6), kv, idx, sink, query_rope, impl="pallas", **kw)
    out, pre = (np.asarray(x.astype(jnp.float32)) for x in (out, pre))
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(out, pre)
    else:
        assert np.abs(out - pre).max() <= 1e-5 * np.abs(pre).max()
    unnormalized = np.asarray(sparse_attention(raw, kv, idx, sink, query_rope, impl="pallas", **kw), np.float32)
    assert np.any(unnormalized != out)  # the norm is applied (it changes the softmax wherever that is not one-hot)


def test_sparse_attention_impls_on_cpu():
    q, kv, idx, sink = _attention_inputs(1, 2, 8, 128, 30, 40, jnp.float32, seed=5)
    ref = sparse_attention_ref(q, kv, idx, sink, scale=0.2)
    np.testing.assert_array_equal(sparse_attention(q, kv, idx, sink, scale=0.2, impl="ref"), ref)
    if jax.default_backend() == "cpu":  # "auto" is the reference where no kernel exists
        np.testing.assert_array_equal(sparse_attention(q, kv, idx, sink, scale=0.2), ref)
    jitted = jax.jit(lambda *x: sparse_attention(*x, scale=0.2, impl="pallas"))
    _check(jitted(q, kv, idx, sink), ref)
    with pytest.raises(ValueError):
        sparse_attention(q, kv, idx, sink, scale=0.2, impl="triton")


def _record_inputs(b, t, h, d, rope, n, k, dtype, seed):
    """Attention inputs whose kv is FP8 records (words `[b, n, R / 4]`) of values whose 64-value
    blocks differ in magnitude by up to e^±9, so the scales differ per block and row; the
    reference decodes the same words."""
    q, _, idx, sink = _attention_inputs(b, t, h, d, n, k, dtype, seed)
    ks = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    mag = jnp.repeat(jnp.exp(3 * jax.random.normal(ks[0], (b, n, -(-d // 64)))), 64, axis=-1)[..., :d]
    values = jax.random.normal(ks[1], (b, n, d), jnp.float32) * mag
    return q, kv_record.to_words(kv_record.encode(values, rope)), idx, sink


@pytest.mark.parametrize(
    "b, t, h, d, rope, n, k, dtype",
    [
        (2, 1, 16, 512, 64, 300, 160, jnp.bfloat16),  # decode, DeepSeek-V4's 584-byte record
        (2, 1, 8, 512, 64, 41, 96, jnp.float32),  # decode, one partial key block
        (2, 3, 8, 128, 32, 50, 200, jnp.float32),  # prefill, 2 key blocks, duplicates
        (1, 4, 8, 64, 16, 30, 130, jnp.bfloat16),  # 48 NoPE values: one partial scale block
        (1, 2, 8, 128, 0, 20, 40, jnp.float32),  # no RoPE part (the indexer keys' records)
    ],
)
def test_sparse_attention_reads_fp8_records(b, t, h, d, rope, n, k, dtype):
    """The TPU kernel gathers the records' words and decodes them itself (the ref decodes them all
    first): the same outputs, to the tolerances above (the decoded values are exact in both)."""
    q, kv, idx, sink = _record_inputs(b, t, h, d, rope, n, k, dtype, seed=d + k)
    assert sat.records_supported(d, rope)
    out = sparse_attention(q, kv, idx, sink, scale=d ** -0.5, impl="pallas", rope_dim=rope)
    ref = sparse_attention_ref(q, kv, idx, sink, scale=d ** -0.5, rope_dim=rope)
    assert out.dtype == q.dtype
    _check(out, ref)
    assert np.abs(np.asarray(ref.astype(jnp.float32))).max() > 0
    assert np.all(np.asarray(out[0, 0].astype(jnp.float32)) == 0.0)  # the row with no valid key


def test_sparse_attention_unselected_records_do_not_leak():
    """Records nobody selects hold NaN codes and NaN RoPE halves, and a -1 slot's buffer keeps an
    earlier block's words: neither reaches the output."""
    q, kv, _, sink = _record_inputs(1, 2, 8, 128, 32, 64, 384, jnp.bfloat16, seed=11)
    kv = kv.at[:, 1::2].set(jnp.uint32(0xFFFFFFFF))  # e4m3 0xFF and bf16 0xFFFF: NaN
    even, slots = (2 * jnp.arange(384, dtype=jnp.int32)) % 64, jnp.arange(384)
    idx = jnp.stack([jnp.where(slots < 128, even, -1), jnp.where(slots % 3 == 0, even, -1)])[None]
    out = sparse_attention(q, kv, idx, sink, scale=0.1, impl="pallas", rope_dim=32)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    _check(out, sparse_attention_ref(q, kv, idx, sink, scale=0.1, rope_dim=32))


# ----------------------------------------------------------------------------- compressor

def _compressor_inputs(b, n, ratio, d, prev, seed, rope=64):
    c = 2 * d if ratio == 4 else d
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    a = jax.random.normal(ks[0], (b, n * ratio, c), jnp.float32)
    z = 2 * jax.random.normal(ks[1], (b, n * ratio, c), jnp.float32)
    w = 1 + 0.1 * jax.random.normal(ks[2], (d,), jnp.float32)
    angles = jax.random.uniform(ks[3], (b, n, rope // 2), jnp.float32, 0, 6.3)
    pa = jax.random.normal(ks[4], (b, ratio, c), jnp.float32) if prev else None
    pz = 2 * jax.random.normal(ks[5], (b, ratio, c), jnp.float32) if prev else None
    return a, z, w, jnp.cos(angles), jnp.sin(angles), pa, pz


@pytest.mark.parametrize(
    "b, n, ratio, d, prev, out_dtype, block_entries",
    [
        (2, 5, 4, 128, False, jnp.float32, None),
        (2, 5, 4, 128, True, jnp.float32, None),
        (1, 40, 4, 128, True, jnp.float32, 16),  # 3 tiles, the last partial: tile edges via the tail rows
        (1, 40, 4, 128, False, jnp.bfloat16, 16),
        (1, 3, 4, 512, True, jnp.bfloat16, None),  # d = 512
        (1, 2, 4, 512, False, jnp.float32, None),
        (2, 3, 128, 128, False, jnp.float32, None),
        (1, 20, 128, 128, False, jnp.bfloat16, 16),  # 2 tiles
        (1, 2, 128, 512, True, jnp.float32, None),  # prev is ignored without overlap
    ],
)
def test_compress_matches_ref(b, n, ratio, d, prev, out_dtype, block_entries):
    a, z, w, cos, sin, pa, pz = _compressor_inputs(b, n, ratio, d, prev, seed=n * 7 + d + ratio)
    ref = compress_ref(a, z, w, cos, sin, ratio=ratio, eps=1e-6, prev_a=pa, prev_z=pz, out_dtype=out_dtype)
    if block_entries is None:
        out = compress(a, z, w, cos, sin, ratio=ratio, eps=1e-6, prev_a=pa, prev_z=pz, out_dtype=out_dtype,
                       impl="pallas")
    else:
        out = compress_tpu(a, z, w, cos, sin, ratio=ratio, eps=1e-6, prev_a=pa, prev_z=pz, out_dtype=out_dtype,
                           interpret=True, block_entries=block_entries)
    assert out.dtype == out_dtype and out.shape == (b, n, d)
    _check(out, ref)


def test_compress_empty_and_ref_impl():
    a, z, w, cos, sin, _, _ = _compressor_inputs(1, 0, 4, 128, False, seed=1)
    assert compress(a, z, w, cos, sin, ratio=4, eps=1e-6, impl="pallas").shape == (1, 0, 128)
    a, z, w, cos, sin, pa, pz = _compressor_inputs(1, 2, 4, 128, True, seed=2)
    ref = compress_ref(a, z, w, cos, sin, ratio=4, eps=1e-6, prev_a=pa, prev_z=pz)
    np.testing.assert_array_equal(compress(a, z, w, cos, sin, ratio=4, eps=1e-6, prev_a=pa, prev_z=pz, impl="ref"), ref)
    assert set(pallas_kernels.__all__) >= {"compress", "compress_ref", "sparse_attention", "sparse_attention_ref"}


# ----------------------------------------------------------------------------- quantized matmul

def _fp8_weight(n, k, dtype, seed, float_scales=False):
    """A random FP8 weight `[n, k]`: e4m3 values over their whole range (subnormals included) and
    power-of-two block scales (E8M0, as V4 stores them), or arbitrary positive float scales."""
    from dsv4_jax.model.quantized import QuantizedWeight

    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((n, k)) * 2.0 ** rng.integers(-9, 8, (n, k))).clip(-448, 448)
    blocks = (-(-n // 128), -(-k // 128))
    scale = rng.uniform(0.001, 0.1, blocks) if float_scales else 2.0 ** rng.integers(-12, 2, blocks)
    return QuantizedWeight(jnp.asarray(values, jnp.float8_e4m3fn), jnp.asarray(scale, jnp.float32), fmt="fp8",
                           dtype_name=jnp.dtype(dtype).name)


@pytest.mark.parametrize("m", [1, 3, 8, 64, 512])
@pytest.mark.parametrize("n, k, dtype", [(256, 1024, jnp.float32), (200, 300, jnp.float32),
                                         (1100, 2100, jnp.bfloat16), (384, 640, jnp.bfloat16)])
def test_fp8_matmul_matches_ref(m, n, k, dtype):
    """The kernel in the interpreter against dequantize-then-multiply: M from decode to a prefill
    chunk, N and K multiples of 128 and not (the last tiles masked), several K steps."""
    from pallas_kernels.quantized_matmul_tpu import fp8_matmul_tpu

    w = _fp8_weight(n, k, dtype, seed=m + n, float_scales=(m == 3))
    x = jnp.asarray(np.random.default_rng(k + m).standard_normal((m, k)), dtype)
    out = fp8_matmul_tpu(x, w.values, w.scale, interpret=True)
    _check(out, pallas_kernels.quantized_matmul_ref(x, w))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_matmul_dequantizes_exactly(dtype):
    """x = the identity: every output is one product with 1.0, so the kernel must give the
    dequantized weight bit for bit (what `dsv4-convert --dtype float32|bfloat16` writes), float
    scales included, with small tiles so that several N and K tiles and the masked tail are hit."""
    from pallas_kernels.quantized_matmul_tpu import fp8_matmul_tpu

    n, k = 300, 260
    w = _fp8_weight(n, k, dtype, seed=7, float_scales=True)
    out = fp8_matmul_tpu(jnp.eye(k, dtype=dtype), w.values, w.scale, interpret=True, block_shape=(64, 128, 128))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(w.dequantize(dtype).T.astype(jnp.float32)))


@pytest.mark.parametrize("impl", ["ref", "pallas"])
def test_quantized_matmul_reads_a_layer_of_a_stack(impl):
    """With `layer` (traced, as inside the layer scan), the weight is a stack `[L, N, K]` and the
    result is x times layer `layer`'s weight (the kernel indexes the stack; nothing sliced out)."""
    from dsv4_jax.model.quantized import QuantizedWeight

    parts = [_fp8_weight(200, 300, jnp.float32, seed=s) for s in (11, 12, 13)]
    stack = QuantizedWeight(jnp.stack([p.values for p in parts]), jnp.stack([p.scale for p in parts]), fmt="fp8")
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 300)), jnp.float32)
    run = jax.jit(lambda x, s, i: pallas_kernels.quantized_matmul(x, s, layer=i, impl=impl))
    for i in (2, 0):
        _check(run(x, stack, jnp.int32(i)), pallas_kernels.quantized_matmul_ref(x, parts[i]))
    with pytest.raises(ValueError, match=r"needs \[L, N, K\]"):
        pallas_kernels.quantized_matmul(x, parts[0], layer=0)


def test_quantized_matmul_impls_and_errors():
    """`quantized_matmul`: leading axes kept; on CPU "auto" is the reference itself and "pallas"
    the interpreted kernel; a weight that does not fit x is a clear error."""
    w = _fp8_weight(256, 384, jnp.float32, seed=1)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 384)), jnp.float32)
    ref = pallas_kernels.quantized_matmul_ref(x.reshape(6, 384), w).reshape(2, 3, 256)
    np.testing.assert_array_equal(np.asarray(pallas_kernels.quantized_matmul(x, w)), np.asarray(ref))
    _check(pallas_kernels.quantized_matmul(x, w, impl="pallas"), ref)
    with pytest.raises(ValueError, match=r"x \(2, 3, 384\) and a weight \[256, 512\] \(needs \[N, K\]"):
        pallas_kernels.quantized_matmul(x, _fp8_weight(256, 512, jnp.float32, seed=3))


@pytest.mark.parametrize("m", [1, 3, 8, 64, 512])
@pytest.mark.parametrize("n, k, dtype", [(256, 1024, jnp.float32), (200, 352, jnp.bfloat16)])
def test_fp4_matmul_matches_ref(m, n, k, dtype):
    """An FP4 weight (e2m1 values, per-32 E8M0 scales along K) through `quantized_matmul`'s
    kernel (the grouped matmul's, one group of every row; the TPU kernel in the interpreter)
    against dequantize-then-multiply, N and K multiples of 128 and not; also a layer of a stack
    read in place, and leading axes of x kept."""
    from test_grouped_matmul import _weight

    from dsv4_jax.model.quantized import QuantizedWeight

    w = _weight("fp4", (), n, k, seed=m + n).replace(dtype_name=jnp.dtype(dtype).name)
    x = jnp.asarray(np.random.default_rng(k + m).standard_normal((m, k)), dtype)
    want = pallas_kernels.quantized_matmul_ref(x, w)
    _check(pallas_kernels.quantized_matmul(x, w, impl="pallas"), want)
    _check(pallas_kernels.quantized_matmul(x, w), want)
    if m == 3:
        other = _weight("fp4", (), n, k, seed=1).replace(dtype_name=w.dtype_name)
        stack = QuantizedWeight(jnp.stack([other.values, w.values]), jnp.stack([other.scale, w.scale]), fmt="fp4",
                                dtype_name=w.dtype_name)
        run = jax.jit(lambda x, s, i: pallas_kernels.quantized_matmul(x, s, layer=i, impl="pallas"))
        _check(run(x, stack, jnp.int32(1)), want)
        _check(pallas_kernels.quantized_matmul(x.reshape(1, 3, k), w, impl="pallas"), want.reshape(1, 3, n))
