"""The Pallas kernels compiled ahead of time by the real compilers (libtpu's Mosaic for TPU v5p, v6e
and v7x; XLA's CUDA plugin, Mosaic GPU and ptxas for an H100), from abstract inputs, on this CPU
machine (dsv4_jax.tools.aot; the `aot` extra). Each compile must succeed, and the compiled program must
hold the Mosaic kernel: a tpu_custom_call / Mosaic GPU custom call with the kernel's name, so a
silent fallback to the plain-JAX reference fails. A missing compiler fails too (no skips).

The shapes are a covering set of the issue's list, not its full product: Flash (H 64, K = 128 +
512) and Pro (H 128, K = 128 + 1024), decode (T 1), prefill (T 16, and 13 and 5: not multiples of
8), bf16 and fp32, D 512, 384 and 128, H 8 to 128, K from 1 to 1152, kv row counts odd and even;
the compressor at both ratios, with and without the previous block, one and several tiles, d 512
and 128, bf16 and fp32 in and out. Every case runs on every target (the FP8 matmul, a TPU kernel
only so far, on the TPU targets).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax.tools import aot
from pallas_kernels import compress
from dsv4_jax.tools import kernel_report as report
from pallas_kernels import sparse_attention
from pallas_kernels.quantized_matmul_tpu import fp8_matmul_tpu

TARGETS = ["v5p-8", "v6e-8", "tpu7x-8", "h100x1"]
TPU_TARGETS = [t for t in TARGETS if aot.target(t).platform == "tpu"]
S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32

# (H, D, T, K, N, dtype): q [1, T, H, D] (unrotated: cos, sin [1, T, 32]), kv [1, N, D], indices
# [1, T, K]. N: the window ring (128), the chunk (T) and the compressed rows (decode: the K - 128
# selected ones).
ATTENTION = {
    "flash-decode-bf16": (64, 512, 1, 640, 128 + 1 + 512, BF16),  # N odd: kv padded to whole word rows
    "flash-prefill16-bf16": (64, 512, 16, 640, 128 + 16 + 4, BF16),
    "flash-prefill16-fp32": (64, 512, 16, 640, 128 + 16 + 4, F32),
    "pro-decode-fp32": (128, 512, 1, 1152, 128 + 1 + 1024, F32),
    "pro-prefill13-bf16": (128, 512, 13, 1152, 128 + 13 + 3, BF16),
    "d128-decode-k1-fp32": (64, 128, 1, 1, 2, F32),
    "d128-prefill5-k129-bf16": (64, 128, 5, 129, 200, BF16),
    # Mosaic GPU's head groups of 64: H 8 padded to one group; H 96 to two, D 384 in 128-wide TMA boxes.
    "h8-prefill2-bf16": (8, 512, 2, 200, 300, BF16),
    "h96-d384-prefill2-bf16": (96, 384, 2, 200, 300, BF16),
}

# FP8 records (rope 64: Flash's 584-byte record, 146 words): (H, D, T, K, N, q dtype). The kernel
# gathers the records and decodes them: on TPU the Mosaic kernel, on CUDA the Pallas-Triton one
# (tests/test_sparse_attention_fp8_gpu.py compiles it for the H100).
RECORDS = {
    "flash-decode-bf16": (64, 512, 1, 640, 128 + 1 + 512, BF16),
    "flash-prefill16-bf16": (64, 512, 16, 640, 128 + 16 + 4, BF16),
    "pro-decode-fp32": (128, 512, 1, 1152, 128 + 1 + 1024, F32),
}


@pytest.mark.parametrize("case", list(RECORDS))
@pytest.mark.parametrize("target", TPU_TARGETS)
def test_sparse_attention_on_fp8_records_compiles(target, case):
    h, d, t, k, n, dtype = RECORDS[case]
    args = (S((1, t, h, d), dtype), S((1, n, 584 // 4), jnp.uint32), S((1, t, k), jnp.int32), S((h,), F32),
            _query_rope(t))
    fn = lambda *x: sparse_attention(*x, scale=d ** -0.5, impl="pallas", rope_dim=64, q_norm_eps=1e-6)  # noqa: E731
    assert _compiled_kernels(target, fn, *args) == ["dsv4_sparse_attention"]


# (ratio, d, n, prev, input dtype, output dtype): a, z [1, n * ratio, C], C = 2d (ratio 4) or d.
COMPRESS = {
    "csa-decode": (4, 512, 1, True, F32, BF16),
    "indexer-decode": (4, 128, 1, True, F32, BF16),
    "csa-prefill-3tiles": (4, 512, 300, True, F32, F32),  # TN 128: two full tiles and a partial one
    "indexer-prefill-noprev-bf16": (4, 128, 4, False, BF16, BF16),
    "hca-decode": (128, 512, 1, False, F32, BF16),
    "hca-prefill-2tiles-prev": (128, 512, 20, True, F32, F32),  # TN 16; prev is ignored at ratio 128
    "hca-d128-bf16": (128, 128, 3, False, BF16, F32),
}


def _query_rope(t):
    """cos, sin at the queries' positions (rope 64), as the model passes them (with q before its
    per-head norm): the kernel normalizes and rotates q in VMEM on TPU; on CUDA the queries'
    kernel normalizes and rotates them first."""
    return (S((1, t, 32), F32),) * 2


def _compiled_kernels(target, fn, *args):
    result = aot.compile_for(target, jax.jit(fn), *args)
    return aot.kernel_calls(result.compiled, aot.target(target).platform)


@pytest.mark.parametrize("case", list(ATTENTION))
@pytest.mark.parametrize("target", TARGETS)
def test_sparse_attention_compiles(target, case):
    h, d, t, k, n, dtype = ATTENTION[case]
    args = (S((1, t, h, d), dtype), S((1, n, d), dtype), S((1, t, k), jnp.int32), S((h,), F32), _query_rope(t))
    fn = lambda *x: sparse_attention(*x, scale=d ** -0.5, impl="pallas", q_norm_eps=1e-6)  # noqa: E731
    queries = ["dsv4_query_norm_rope_gpu"] if aot.target(target).platform == "cuda" else []
    assert _compiled_kernels(target, fn, *args) == queries + ["dsv4_sparse_attention"]


@pytest.mark.parametrize("case", list(COMPRESS))
@pytest.mark.parametrize("target", TARGETS)
def test_compress_compiles(target, case):
    ratio, d, n, prev, dtype, out_dtype = COMPRESS[case]
    c = 2 * d if ratio == 4 else d
    args = [S((1, n * ratio, c), dtype), S((1, n * ratio, c), dtype), S((d,), BF16), S((1, n, 32), F32),
            S((1, n, 32), F32)]
    if prev:
        args += [S((1, ratio, c), dtype)] * 2

    def fn(a, z, w, cos, sin, pa=None, pz=None):
        return compress(a, z, w, cos, sin, ratio=ratio, eps=1e-6, prev_a=pa, prev_z=pz, out_dtype=out_dtype,
                        impl="pallas")

    assert _compiled_kernels(target, fn, *args) == ["dsv4_compress"]


# (M, N, K, dtype): x [M, K] times an FP8 weight [N, K] (128x128 block scales), at the published
# models' FP8 linears: decode (M = batch) and a 512-token prefill chunk, and a shape off the blocks.
FP8_MATMUL = {
    "flash-decode-wq_b": (1, 32768, 1024, BF16),
    "flash-decode4-wo_b": (4, 4096, 8192, BF16),
    "flash-prefill-wq_a": (512, 1024, 4096, BF16),
    "pro-decode-wq_b": (1, 65536, 1536, BF16),
    "pro-prefill-shared_w1": (512, 3072, 7168, BF16),
    "odd-fp32": (3, 200, 300, F32),
}


@pytest.mark.parametrize("case", list(FP8_MATMUL))
@pytest.mark.parametrize("target", TPU_TARGETS)
def test_fp8_matmul_compiles_and_reads_each_byte_once(target, case):
    """The kernel is in the compiled program; its declared cost (what dsv4-plan counts) is at
    least the stored weight (values and scales), x and the output, and on the published shapes
    at most 1% more (x kept in VMEM, the weight read once); and no op but the kernel touches the
    weight (a copy or re-layout of it would be an instruction of its shape). XLA may add copies
    of x into VMEM around the kernel (its memory-space assignment), so the program's own figure
    is only bounded below."""
    m, n, k, dtype = FP8_MATMUL[case]
    stored = n * k + 4 * -(-n // 128) * -(-k // 128)
    args = (S((m, k), dtype), S((n, k), jnp.float8_e4m3fn), S((-(-n // 128), -(-k // 128)), F32))
    result = aot.compile_for(target, jax.jit(lambda x, v, s: fp8_matmul_tpu(x, v, s)), *args)
    assert aot.kernel_calls(result.compiled, "tpu") == ["dsv4_fp8_matmul"]
    minimum = stored + (m * k + m * n) * jnp.dtype(dtype).itemsize
    declared = report._tpu_facts(result.compiled)["declared_cost"]["bytes_accessed"]
    assert result.cost["bytes accessed"] >= declared >= minimum
    weight_ops = [line for line in result.compiled.as_text().splitlines()
                  if re.search(rf"= f8e4m3fn\[{n},{k}\]", line) and " parameter(" not in line]
    if not case.startswith("odd"):  # K = 300 is laid out in other tiles than the kernel's: a copy
        assert declared <= 1.01 * minimum
        assert weight_ops == []
