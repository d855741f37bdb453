"""The GPU sparse attention over FP8 KV records (pallas_kernels/sparse_attention_fp8_gpu.py,
Pallas-Triton): its numerics in the Pallas interpreter on CPU against
`sparse_attention_ref(..., rope_dim=...)` (which decodes every record, then attends), its
decoding bit for bit, and its compile for an H100 (XLA's CUDA compiler, Triton and ptxas, sm_90a;
no GPU needed) through `sparse_attention`, where the compiled program must hold the named kernel
and nothing that decodes the cache. A missing compiler fails (no skips).

Tolerances (`_check`): kernel and reference attend over the same decoded values (e4m3 times a
power of two, exact in bf16 and fp32) with fp32 softmax and sums. The kernel's products are bf16
tensor-core dots whose other operand is split into bf16 pieces (fp32 q and p: three, ~24 bits;
bf16 q: one, p: two, ~16 bits), so what differs is the order of the fp32 sums, the pieces' last
bits and, for bf16, the one rounding of the output:
* fp32 q: max |kernel - ref| <= 1e-5 * max |ref| (measured: ~1e-6);
* bf16 q: max |kernel - ref| <= 2^-6 * max |ref| and under 1% of the elements differ: the fp32
  results agree to ~1e-6 relative, but a last-bit difference can flip the rounding to bf16
  (1 ulp, 2^-8 relative at most; measured: 0.06% of the elements at Flash decode).
The decoding test needs no tolerance: one valid key per token and a sink of -1e30 make every
weight exactly 1, so the output is the decoded row itself.

The interpreter does not model Triton's layouts, pipelining or the tensor cores; the compile
tests prove the kernel lowers for sm_90a, not its speed (nothing here ran on a GPU).
"""

from __future__ import annotations

import re

from dsv4_jax.tools import aot  # first: it lets JAX's CUDA plugin register without a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dsv4_jax.tools import kernel_report  # noqa: E402
from pallas_kernels import kv_record, sparse_attention  # noqa: E402
from pallas_kernels import sparse_attention_fp8_gpu as fp8  # noqa: E402
from pallas_kernels.sparse_attention_ref import sparse_attention_ref  # noqa: E402
from test_kernels import _check as kernels_check  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
_encode = jax.jit(kv_record.encode, static_argnums=1)  # eager, it takes longer than the kernel's compile


def _check(out, ref):
    """Finite, and within test_kernels' tolerances of the reference."""
    assert np.isfinite(np.asarray(out.astype(F32))).all()
    kernels_check(out, ref)


def _inputs(b, t, h, d, rope, k, n, dtype, seed):
    """Records of values whose magnitudes vary by row and within rows (so the 64-value blocks
    get different scales), q, indices with -1 padding and duplicates (k > n, or by chance), a
    token with no valid key, a window-like token (the first keys valid and one repeated, the
    rest padding), and the sink. Returns (q, words, clean words, indices, sink): `words` holds
    NaN-pattern garbage in the rows no index selects (row 0 and the last half), `clean` has
    zeros there, for the reference (which gathers row 0 for -1 slots and multiplies it by 0)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, n, d)) * np.exp(rng.uniform(-4, 4, (b, n, 1)) + rng.uniform(-3, 3, (b, n, d)))
    clean = np.array(kv_record.to_words(_encode(jnp.asarray(x, F32), rope)))
    q = jnp.asarray(rng.standard_normal((b, t, h, d)) * 0.05, dtype)
    top = max(2, n // 2)  # rows 1 .. top - 1 are selected, the others never
    idx = np.where(rng.random((b, t, k)) < 0.2, -1, rng.integers(1, top, (b, t, k))).astype(np.int32)
    idx[0, 0] = -1
    if t > 1:
        idx[-1, 1] = np.where(np.arange(k) < max(k // 3, 2), 1 + np.arange(k) % (top - 1), -1)
        idx[-1, 1, 1] = 1
    clean[:, 0] = 0
    clean[:, top:] = 0
    words = clean.copy()
    words[:, 0] = words[:, top:] = 0xFFFFFFFF  # e4m3 NaN codes, a scale byte of 255, NaN bf16 RoPE values
    words[:, 0, ::3] = words[:, top:, ::3] = 0x7FC07FFF
    sink = jnp.asarray(rng.standard_normal(h), F32)
    return q, jnp.asarray(words), jnp.asarray(clean), jnp.asarray(idx), sink


# (B, T, H, D, rope, K, N, dtype): Flash decode (H 64, D 512, rope 64, K 640, N = 128 + 1 + 512),
# a prefill at D 512 (T 2, fp32), D 128 with rope 32 (nope 96: a last partial scale block; H 20:
# two head groups, the second masked), D 64 with rope 16 (K 5 < one key block, T 3), and
# D 128 with no RoPE part (an indexer key's layout).
CASES = {
    "flash-decode-bf16": (1, 1, 64, 512, 64, 640, 641, BF16),
    "d512-prefill2-fp32": (1, 2, 8, 512, 64, 200, 300, F32),
    "d128-rope32-h20-fp32": (2, 1, 20, 128, 32, 40, 17, F32),
    "d64-rope16-prefill3-bf16": (2, 3, 20, 64, 16, 5, 9, BF16),
    "d128-rope0-prefill2-bf16": (1, 2, 3, 128, 0, 70, 50, BF16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_attention_matches_ref(case):
    b, t, h, d, rope, k, n, dtype = CASES[case]
    q, words, clean, idx, sink = _inputs(b, t, h, d, rope, k, n, dtype, seed=len(case))
    assert fp8.supported(dtype, h, d, k, rope)
    out = fp8.sparse_attention_fp8_gpu(q, words, idx, sink, scale=d ** -0.5, rope_dim=rope, interpret=True)
    ref = jax.jit(sparse_attention_ref, static_argnames=("scale", "rope_dim"))(q, clean, idx, sink, scale=d ** -0.5,
                                                                              rope_dim=rope)
    assert out.shape == q.shape and out.dtype == dtype
    _check(out, ref)
    np.testing.assert_array_equal(np.asarray(out[0, 0].astype(F32)), 0)  # the token with no valid key


def _hand_records(n, d, rope, seed):
    """Records built byte by byte: every finite e4m3 code (all but 0x7F and 0xFF, subnormals and
    both zeros included), scale bytes from 2^-22 to 2^23, random bf16 RoPE values."""
    rng = np.random.default_rng(seed)
    nope = d - rope
    size = kv_record.record_bytes(d, rope)
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    rec = np.zeros((n, size), np.uint8)
    rec[:, :nope] = np.resize(rng.permutation(np.tile(codes, -(-n * nope // codes.size))), (n, nope))
    rope_vals = (rng.standard_normal((n, rope)) * 10).astype(jnp.bfloat16)
    rec[:, nope:nope + 2 * rope] = rope_vals.view(np.uint8).reshape(n, 2 * rope)
    blocks = -(-nope // 64)
    rec[:, nope + 2 * rope:nope + 2 * rope + blocks] = rng.integers(105, 151, (n, blocks))
    return jnp.asarray(rec)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_attention_decodes_exactly(dtype):
    """Token t selects only row t (between -1 slots), with a sink of -1e30: its weight is exactly 1
    and the output is the decoded row, bit for bit (D 128, rope 32: a partial scale block)."""
    n, d, rope = 12, 128, 32
    rec = _hand_records(n, d, rope, seed=3)
    words = kv_record.to_words(rec)[None]
    q = jnp.asarray(np.random.default_rng(4).standard_normal((1, n, 4, d)) * 0.05, dtype)
    idx = jnp.stack([-jnp.ones(n, jnp.int32), jnp.arange(n, dtype=jnp.int32), -jnp.ones(n, jnp.int32)], -1)[None]
    sink = jnp.full((4,), -1e30, F32)
    out = fp8.sparse_attention_fp8_gpu(q, words, idx, sink, scale=d ** -0.5, rope_dim=rope, interpret=True)
    want = kv_record.decode(rec, d, rope, F32).astype(dtype)
    np.testing.assert_array_equal(np.asarray(out[0].astype(F32)),
                                  np.broadcast_to(np.asarray(want.astype(F32))[:, None], (n, 4, d)))


def test_fp8_attention_falls_back_to_ref():
    """Layouts whose words mix NoPE and RoPE bytes (nope not a multiple of 4) or whose RoPE part
    is odd, fp16 q, H = 0 and K = 0 run the reference, without raising."""
    assert not fp8.supported(F32, 4, 64, 8, 15) and not fp8.supported(jnp.float16, 4, 512, 8, 64)
    assert not fp8.supported(F32, 0, 512, 8, 64) and not fp8.supported(F32, 4, 512, 0, 64)
    assert fp8.supported(BF16, 128, 512, 1152, 64) and fp8.supported(F32, 1, 128, 1, 0)
    d, rope = 66, 16
    assert not fp8.supported(F32, 4, d, 8, rope)
    q, _, words, idx, sink = _inputs(1, 1, 4, d, rope, 8, 6, F32, seed=d)
    run = jax.jit(fp8.sparse_attention_fp8_gpu, static_argnames=("scale", "rope_dim", "interpret"))
    ref = jax.jit(sparse_attention_ref, static_argnames=("scale", "rope_dim"))
    np.testing.assert_array_equal(np.asarray(run(q, words, idx, sink, scale=0.1, rope_dim=rope, interpret=True)),
                                  np.asarray(ref(q, words, idx, sink, scale=0.1, rope_dim=rope)))


def test_fp8_attention_declared_cost():
    """Each selected record once per token (K * R bytes), the indices, q, the output and the sink;
    4 H K D flops per token (logits and weighted sum)."""
    b, t, h, d, rope, k, n = 2, 3, 64, 512, 64, 640, 641
    args = (S((b, t, h, d), BF16), S((b, n, 146), jnp.uint32), S((b, t, k), jnp.int32), S((h,), F32))
    jaxpr = jax.make_jaxpr(lambda *x: fp8.sparse_attention_fp8_gpu(*x, scale=0.04, rope_dim=rope))(*args)
    [cost] = [e.params["cost_estimate"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert cost.bytes_accessed == b * t * (k * 584 + 4 * k + 2 * h * d * 2) + 4 * h
    assert cost.flops == 4 * b * t * h * k * d


# (H, D, rope, T, K, N, dtype): Flash decode and prefill (T 16), Pro decode (H 128, K 128 + 1024),
# and a small model's shape (H 20, D 128, rope 32, T 3, K 5; its output is padded: a slice).
COMPILE = {
    "flash-decode-bf16": (64, 512, 64, 1, 640, 128 + 1 + 512, BF16),
    "flash-prefill16-bf16": (64, 512, 64, 16, 640, 128 + 16 + 4, BF16),
    "pro-decode-fp32": (128, 512, 64, 1, 1152, 128 + 1 + 1024, F32),
    "small-prefill3-fp32": (20, 128, 32, 3, 5, 9, F32),
}


def _compile(case, impl, options=None):
    h, d, rope, t, k, n, dtype = COMPILE[case]
    w = kv_record.record_bytes(d, rope) // 4
    args = (S((1, t, h, d), dtype), S((1, n, w), jnp.uint32), S((1, t, k), jnp.int32), S((h,), F32))
    fn = lambda *x: sparse_attention(*x, scale=d ** -0.5, impl=impl, rope_dim=rope)  # noqa: E731
    return aot.compile_for("h100x1", jax.jit(fn), *args, compiler_options=options).compiled, args


@pytest.mark.parametrize("case", list(COMPILE))
def test_fp8_attention_compiles_for_hopper(case, tmp_path):
    """Through `sparse_attention` (impl "pallas"; "auto" at Flash decode), the H100 program holds
    the one Triton kernel, named, with its declared cost in the op_name, and no other op reads the
    records (the entry is parameters, bitcasts and the call; the small shape's padded output adds
    a slice). At Flash decode, with XLA's default GPU optimization (as kernel_report compiles),
    ptxas (sm_90a) reports no spills."""
    impls = ["pallas", "auto"] if case == "flash-decode-bf16" else ["pallas"]
    for impl in impls:
        options = None
        if case == "flash-decode-bf16" and impl == "pallas":
            options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "NONE", **kernel_report.XLA_GPU_DEFAULTS}
        compiled, args = _compile(case, impl, options)
        text = compiled.as_text()
        assert aot.kernel_calls(compiled, "cuda") == [fp8.KERNEL_NAME]
        [call] = [line for line in text.splitlines() if f'custom_call_target="{aot.TRITON_CALL}"' in line]
        h, d, rope, t, k, _, dtype = COMPILE[case]
        cost = fp8.cost_estimate(t, h, d, k, rope, jnp.dtype(dtype).itemsize)
        assert f"declared_cost_{cost.flops}_{cost.bytes_accessed}/{fp8.KERNEL_NAME}" in call
        entry = text[text.index("ENTRY"):]
        ops = re.findall(r"= \S+ (\w[\w-]*)\(", entry)
        allowed = {"parameter", "bitcast", "custom-call"} | ({"fusion", "slice"} if case.startswith("small") else set())
        assert set(ops) <= allowed, ops
        if options:
            facts = kernel_report._triton_facts(compiled, fp8.KERNEL_NAME, str(tmp_path))
            assert facts["arch"] == "sm_90a"
            assert facts["spill_bytes"] == {"stores": 0, "loads": 0}, facts
            assert facts["grid"] == [4, 1, 1]  # 64 heads in groups of 16, one token
