"""`python -m dsv4_jax.tools.kernel_report`: what the real compilers say about each kernel at
DeepSeek-V4-Flash decode and prefill shapes, as JSON (one record per target and case).

Each kernel is compiled ahead of time (dsv4_jax.tools.aot; the `aot` extra, no accelerator needed) for
TPU v5p, TPU v6e, TPU v7x and an H100 (the FP8 and grouped matmuls: their Mosaic TPU kernels on
TPU, their Pallas-Triton kernels, named "..._gpu", on CUDA; the hyper-connections' collapse is
one kernel on TPU and two on CUDA, its mixes and its sum, each a case; the indexer's scores over
bf16 keys on CUDA only, over FP8 records on both), and the record holds:
  * TPU: "vmem_bytes", the scoped VMEM the compiler allocated to the Mosaic kernel (its
    custom call's used_scoped_memory_configs); "xla_cost", XLA's cost analysis of the compiled
    program per device (for the kernel's custom call XLA takes the kernel's own declared
    pl.CostEstimate, shown as "declared_cost"; the rest is the wrapper's XLA ops);
  * GPU, Mosaic GPU kernels: "smem_bytes" (the kernel launch's dynamic shared memory, from
    Mosaic GPU's MLIR dump), "registers" and "spill_bytes" per thread (ptxas's log:
    MOSAIC_GPU_DUMP_PTXAS). Mosaic GPU dumps a kernel only when it compiles it, once per process,
    so the report runs in a fresh one;
  * GPU, Pallas-Triton kernels (XLA's `__gpu$xla.gpu.triton` call; the Mosaic dump does not see
    them): from XLA's own dump of the compile (xla_dump_to), the launch's "grid", "threads" per
    block and "smem_bytes" (its shared memory) in the thunk sequence, and "registers" and
    "spill_bytes" from `ptxas -v` run on the dumped PTX of the kernel's entry (the ptxas
    `dsv4_jax.tools.aot` puts first on PATH, the one XLA uses); "declared_cost", the kernel's
    pl.CostEstimate, which the Triton lowering drops, from its op_name
    (`_dispatch.declared_cost_scope`);
  * both: "program_memory" (XLA's memory analysis) and "minimum_bytes": what the kernel must
    move at least, every needed byte read once and the output written once (sparse attention:
    indices, the selected rows counted once each, q, its rope's cos and sin, and the output;
    compressor: a, z, prev's first halves, cos, sin, the norm weight and the output; FP8
    matmul: the stored weight, values and scales, x and the output; grouped matmul: the stored
    bytes of min(E, M) experts, x and the output; hyper-connections: the streams, fn, the
    per-token weights and the outputs (on CUDA the collapse's mixes: the streams, fn and the
    partials; its sum: the streams, the weights and the output); indexer scores: the queries,
    the keys (or their FP8 records), the weights and the scores).
Usage: python -m dsv4_jax.tools.kernel_report [--targets v5p-8,v6e-8,tpu7x-8,h100x1]
"""

from __future__ import annotations

from . import aot  # first: it lets JAX's CUDA plugin register without a GPU

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import compress, kv_record, sparse_attention  # noqa: E402
from pallas_kernels._dispatch import DECLARED_COST  # noqa: E402
from pallas_kernels.fp8_activations_gpu import fp8_activation_matmul_gpu  # noqa: E402
from pallas_kernels.fp8_activations_tpu import fp8_activation_matmul_tpu  # noqa: E402
from pallas_kernels.grouped_matmul_gpu import (block_diagonal_matmul_gpu, grouped_matmul_gpu,  # noqa: E402
                                               grouped_swiglu_gpu)
from pallas_kernels.grouped_matmul_tpu import (block_diagonal_matmul_tpu, grouped_matmul_tpu,  # noqa: E402
                                               grouped_swiglu_tpu)
from pallas_kernels.hyper_connection_gpu import MIXES_BK, hc_expand_gpu, hc_mixes_gpu, hc_sum_gpu  # noqa: E402
from pallas_kernels.hyper_connection_tpu import hc_collapse_tpu, hc_expand_tpu  # noqa: E402
from pallas_kernels.indexer_scores_gpu import indexer_scores_gpu  # noqa: E402
from pallas_kernels.indexer_scores_tpu import indexer_scores_tpu  # noqa: E402
from pallas_kernels.quantized_matmul_gpu import fp8_matmul_gpu  # noqa: E402
from pallas_kernels.quantized_matmul_tpu import fp8_matmul_tpu  # noqa: E402
from pallas_kernels.query_gpu import query_norm_rope_gpu  # noqa: E402

TARGETS = ("v5p-8", "v6e-8", "tpu7x-8", "h100x1")
S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
# DeepSeek-V4-Flash: 64 heads of 512, window 128, top-k 512 (K = 640), index heads of 128, rope 64;
# 4 streams of 4096 (hyper-connections).
H, D, WINDOW, TOPK, D_INDEX, ROPE = 64, 512, 128, 512, 128, 64
HC, HIDDEN = 4, 4096
PREFILL = 512  # tokens per prefill chunk (the compressors); the attention's prefill is 16 tokens
ATTN_PREFILL, POOL = 16, 1024  # 1024 compressed entries: a 4096-token context


def _attention_case(t: int, records: bool = False) -> dict:
    """Flash sparse attention over [ring | chunk | compressed rows]: decode reads the K selected
    compressed rows (N = 128 + 1 + 512), prefill the chunk's pool (N = 128 + 16 + 1024); bf16
    rows, or with `records` FP8 records (584 bytes, 146 words) that the kernel decodes; the queries
    rotated in the kernel, as the model calls it."""
    k = WINDOW + TOPK
    n = WINDOW + t + (TOPK if t == 1 else POOL)
    row_bytes = kv_record.record_bytes(D, ROPE) if records else D * 2
    kv = S((1, n, row_bytes // 4), jnp.uint32) if records else S((1, n, D), BF16)
    rope = (S((1, t, ROPE // 2), F32),) * 2  # cos, sin
    args = (S((1, t, H, D), BF16), kv, S((1, t, k), jnp.int32), S((H,), F32), rope)
    rows = min(t * k, n)  # every needed row once (all K indices valid, distinct within a token)
    minimum = t * k * 4 + rows * row_bytes + 2 * t * H * D * 2 + t * ROPE * 4
    shapes = {"B": 1, "T": t, "H": H, "D": D, "K": k, "N": n, "dtype": "fp8 records" if records else "bfloat16"}
    return {"fn": lambda *x: sparse_attention(*x, scale=D ** -0.5, impl="pallas", rope_dim=ROPE if records else None),
            "args": args, "shapes": shapes, "minimum_bytes": minimum}


def _compress_case(ratio: int, d: int, n: int) -> dict:
    """A compressor at Flash shapes: fp32 a and z (as the model's state), bf16 output; ratio 4
    with the previous block (its first halves are read)."""
    c = 2 * d if ratio == 4 else d
    prev = ratio == 4
    args = [S((1, n * ratio, c), F32), S((1, n * ratio, c), F32), S((d,), F32), S((1, n, ROPE // 2), F32),
            S((1, n, ROPE // 2), F32)] + ([S((1, ratio, c), F32)] * 2 if prev else [])

    def fn(a, z, w, cos, sin, pa=None, pz=None):
        return compress(a, z, w, cos, sin, ratio=ratio, eps=1e-6, prev_a=pa, prev_z=pz, out_dtype=BF16,
                        impl="pallas")

    minimum = (2 * n * ratio * c * 4 + (2 * ratio * d * 4 if prev else 0) + 2 * n * (ROPE // 2) * 4 + d * 4
               + n * d * 2)
    shapes = {"B": 1, "n": n, "ratio": ratio, "d": d, "C": c, "prev": prev, "in": "float32", "out": "bfloat16"}
    return {"fn": fn, "args": args, "shapes": shapes, "minimum_bytes": minimum}


def _fp8_matmul_case(m: int, n: int, k: int) -> dict:
    """x `[m, k]` bf16 times a Flash FP8 weight `[n, k]` (e4m3, float32 128x128 block scales)."""
    blocks = (-(-n // 128), -(-k // 128))
    args = (S((m, k), BF16), S((n, k), jnp.float8_e4m3fn), S(blocks, F32))
    minimum = n * k + 4 * blocks[0] * blocks[1] + 2 * (m * k + m * n)
    return {"fn": {"tpu": fp8_matmul_tpu, "cuda": fp8_matmul_gpu}, "args": args,
            "shapes": {"M": m, "N": n, "K": k, "x": "bfloat16"}, "minimum_bytes": minimum}


def _fp8_activation_matmul_case(m: int, n: int, k: int) -> dict:
    """x `[m, k]` quantized as `act_quant` leaves it (e4m3, float32 scales per 128) times a Flash
    FP8 weight `[n, k]`: e4m3 x e4m3 on Hopper's FP8 tensor cores and v7x's MXU."""
    blocks = (-(-n // 128), -(-k // 128))
    args = (S((m, k), jnp.float8_e4m3fn), S((m, blocks[1]), F32), S((n, k), jnp.float8_e4m3fn), S(blocks, F32))
    minimum = n * k + 4 * blocks[0] * blocks[1] + m * k + 4 * m * blocks[1] + 2 * m * n
    return {"fn": {"tpu": lambda q, s, v, w: fp8_activation_matmul_tpu(q, s, v, w, out_dtype=BF16),
                   "cuda": lambda q, s, v, w: fp8_activation_matmul_gpu(q, s, v, w, out_dtype=BF16)}, "args": args,
            "shapes": {"M": m, "N": n, "K": k, "x": "e4m3 + float32 scales per 128", "out": "bfloat16"},
            "minimum_bytes": minimum}


def _grouped_matmul_case(fmt: str, m: int, n: int, k: int, fused: bool = False) -> dict:
    """bf16 rows `[m, k]` sorted over Flash's 256 routed experts `[256, n, k]` (FP8: e4m3, float32
    128x128 block scales; FP4: e2m1 pairs, E8M0 per-32 scales); decode 8 tokens' top-6 rows
    (48), prefill a 512-token chunk's (3072). fused: the experts' first half (`grouped_swiglu_tpu`,
    `grouped_swiglu_gpu`: w1 and w3, fp32 routing weights `[m]`, one output)."""
    e = 256
    if fmt == "fp8":
        stored = [S((e, n, k), jnp.float8_e4m3fn), S((e, -(-n // 128), -(-k // 128)), F32)]
    else:
        stored = [S((e, n, k // 2), jnp.uint8), S((e, n, -(-k // 32)), jnp.uint8)]
    per_expert = sum(a.size * a.dtype.itemsize for a in stored) // e
    shapes = {"M": m, "E": e, "N": n, "K": k, "weight": fmt, "x": "bfloat16"}
    if fused:  # as many experts as rows, at most all, of both weights; x, the routing weights, the output
        return {"fn": {"tpu": lambda x, g, hw, v1, s1, v3, s3: grouped_swiglu_tpu(x, (v1, s1), (v3, s3), g, hw,
                                                                                  fmt=fmt, limit=10.0),
                       "cuda": lambda x, g, hw, v1, s1, v3, s3: grouped_swiglu_gpu(x, (v1, s1), (v3, s3), g, hw,
                                                                                   fmt=fmt, limit=10.0)},
                "args": (S((m, k), BF16), S((e,), jnp.int32), S((m,), F32), *stored, *stored), "shapes": shapes,
                "minimum_bytes": 2 * min(e, m) * per_expert + 2 * (m * k + m * n) + 4 * m}
    args = (S((m, k), BF16), S((e,), jnp.int32), *stored)
    minimum = min(e, m) * per_expert + 2 * (m * k + m * n)  # as many experts as rows, at most all
    return {"fn": {"tpu": lambda x, g, v, s: grouped_matmul_tpu(x, v, g, fmt=fmt, scale=s),
                   "cuda": lambda x, g, v, s: grouped_matmul_gpu(x, v, g, fmt=fmt, scale=s)},
            "args": args, "shapes": shapes, "minimum_bytes": minimum}


def _output_case(tokens: int) -> dict:
    """Flash's grouped output projection: the attention's output `[tokens, 64 x 512]` bf16 at its
    queries' rotation (rope 64: cos, sin `[tokens, 32]` fp32), rotated back as loaded, times
    wo_a's 8 bf16 blocks `[8, 1024, 4096]` (`block_diagonal_matmul` with x_rope)."""
    g, n, k = 8, 1024, H * D // 8
    args = (S((tokens, g * k), BF16), S((g, n, k), BF16), S((tokens, ROPE // 2), F32), S((tokens, ROPE // 2), F32))

    def per(kernel):
        return lambda x, w, c, s: kernel(x, w, x_rope=(c, s), head_dim=D)

    return {"fn": {"tpu": per(block_diagonal_matmul_tpu), "cuda": per(block_diagonal_matmul_gpu)}, "args": args,
            "shapes": {"M": tokens, "G": g, "N": n, "K": k, "head_dim": D, "rope": ROPE, "x": "bfloat16"},
            "minimum_bytes": 2 * (g * n * k + tokens * g * (k + n)) + 2 * tokens * (ROPE // 2) * 4}


def _query_case(tokens: int) -> dict:
    """The queries of `tokens` tokens `[1, tokens, 64, 512]` bf16 before their per-head norm and
    rotation (rope 64: cos, sin `[1, tokens, 32]` fp32), made ready for the GPU attention kernels
    (on TPU the attention kernel does both)."""
    q, rope = S((1, tokens, H, D), BF16), S((1, tokens, ROPE // 2), F32)
    return {"fn": {"cuda": lambda q, c, s: query_norm_rope_gpu(q, (c, s), eps=1e-6)}, "args": (q, rope, rope),
            "shapes": {"T": tokens, "H": H, "D": D, "rope": ROPE, "x": "bfloat16"},
            "minimum_bytes": 2 * tokens * H * D * 2 + 2 * tokens * (ROPE // 2) * 4}


def _hc_case(kind: str, tokens: int, batch: int) -> dict:
    """The hyper-connections' passes over Flash's bf16 streams `[batch, tokens, 4, 4096]`: the
    collapse before a sub-layer (24 mixes, fp32 fn `[24, 16384]`; on CUDA its two kernels, the
    mixes and the sum, are cases of their own), or the expansion after it."""
    x = S((batch, tokens, HC, HIDDEN), BF16)
    n, rows = batch * tokens, (2 + HC) * HC
    streams = n * HC * HIDDEN * 2
    if kind == "collapse":
        args = (x, S((rows, HC * HIDDEN), F32), S((rows,), F32), S((3,), F32))
        fn = {"tpu": lambda *a: hc_collapse_tpu(*a, hc_eps=1e-6, norm_eps=1e-6)}
        minimum = streams + rows * HC * HIDDEN * 4 + n * (HIDDEN * 2 + rows * 4)
    elif kind == "mixes":
        args = (x, S((rows, HC * HIDDEN), F32))
        fn = {"cuda": hc_mixes_gpu}
        minimum = streams + rows * HC * HIDDEN * 4 + HC * (HIDDEN // MIXES_BK) * n * (rows + 1) * 4
    elif kind == "sum":
        args = (x, S((batch, tokens, HC), F32))
        fn = {"cuda": hc_sum_gpu}
        minimum = streams + n * (HC * 4 + HIDDEN * 2)
    else:
        args = (S((batch, tokens, HIDDEN), BF16), x, S((batch, tokens, HC), F32), S((batch, tokens, HC, HC), F32))
        fn = {"tpu": hc_expand_tpu, "cuda": hc_expand_gpu}
        minimum = n * (HIDDEN * 2 + 2 * HC * HIDDEN * 2 + (HC + HC * HC) * 4)
    return {"fn": fn, "args": args, "minimum_bytes": minimum,
            "shapes": {"B": batch, "S": tokens, "hc": HC, "D": HIDDEN, "x": "bfloat16"}}


def _indexer_scores_case(t: int, n: int, records: bool = False) -> dict:
    """Flash's lightning indexer (64 heads of 128, bf16) scoring n keys for t queries: a decode
    step against a 1M-token context (262,144 keys) or a 512-token prefill chunk (2,176 keys); the
    keys as bf16 values or (records) as the FP8 records of `--kv-cache-dtype fp8`. On TPU keys as
    values take XLA's fused product: no kernel there."""
    key_bytes = kv_record.record_bytes(D_INDEX, 0) if records else 2 * D_INDEX
    keys = S((1, n, key_bytes // 4), jnp.uint32) if records else S((1, n, D_INDEX), BF16)
    args = (S((1, t, H, D_INDEX), BF16), keys, S((1, t, H), F32))
    minimum = 2 * t * H * D_INDEX + n * key_bytes + 4 * (t * H + t * n)
    fn = {"tpu": indexer_scores_tpu, "cuda": indexer_scores_gpu} if records else {"cuda": indexer_scores_gpu}
    return {"fn": fn, "args": args, "minimum_bytes": minimum,
            "shapes": {"B": 1, "T": t, "H": H, "D": D_INDEX, "N": n, "q": "bfloat16",
                       "keys": "fp8 records" if records else "bfloat16"}}


# A case's "fn" is one function for every platform (attention and compressors: their entry
# points, impl="pallas", pick the platform's kernel), or {platform: its kernel's function} (a
# platform not named has no such kernel: no record).
CASES = {
    "sparse_attention/flash-decode": lambda: _attention_case(1),
    "sparse_attention/flash-prefill": lambda: _attention_case(ATTN_PREFILL),
    "sparse_attention/flash-decode-fp8": lambda: _attention_case(1, records=True),
    "sparse_attention/flash-prefill-fp8": lambda: _attention_case(ATTN_PREFILL, records=True),
    "compress/csa-decode": lambda: _compress_case(4, D, 1),
    "compress/csa-prefill": lambda: _compress_case(4, D, PREFILL // 4),
    "compress/indexer-decode": lambda: _compress_case(4, D_INDEX, 1),
    "compress/indexer-prefill": lambda: _compress_case(4, D_INDEX, PREFILL // 4),
    "compress/hca-decode": lambda: _compress_case(128, D, 1),
    "compress/hca-prefill": lambda: _compress_case(128, D, PREFILL // 128),
    "fp8_matmul/wq_b-decode": lambda: _fp8_matmul_case(1, H * D, 1024),
    "fp8_matmul/4096x4096-decode8": lambda: _fp8_matmul_case(8, 4096, 4096),
    "fp8_matmul/wq_a-prefill": lambda: _fp8_matmul_case(PREFILL, 1024, 4096),
    "fp8_activation_matmul/4096x4096-decode8": lambda: _fp8_activation_matmul_case(8, 4096, 4096),
    "fp8_activation_matmul/wq_a-prefill": lambda: _fp8_activation_matmul_case(PREFILL, 1024, 4096),
    "grouped_matmul/fp8-w1-decode": lambda: _grouped_matmul_case("fp8", 8 * 6, 2048, 4096),
    "grouped_matmul/fp4-w1-decode": lambda: _grouped_matmul_case("fp4", 8 * 6, 2048, 4096),
    "grouped_matmul/fp4-w2-prefill": lambda: _grouped_matmul_case("fp4", PREFILL * 6, 4096, 2048),
    "grouped_swiglu/fp4-decode": lambda: _grouped_matmul_case("fp4", 8 * 6, 2048, 4096, fused=True),
    "grouped_swiglu/fp4-prefill": lambda: _grouped_matmul_case("fp4", PREFILL * 6, 2048, 4096, fused=True),
    "indexer_scores/decode-1m": lambda: _indexer_scores_case(1, 262144),
    "indexer_scores/prefill": lambda: _indexer_scores_case(PREFILL, PREFILL // 4 + 2048),
    "indexer_scores/decode-1m-fp8": lambda: _indexer_scores_case(1, 262144, records=True),
    "indexer_scores/prefill-fp8": lambda: _indexer_scores_case(PREFILL, PREFILL // 4 + 2048, records=True),
    "hc_collapse/decode8": lambda: _hc_case("collapse", 1, 8),
    "hc_collapse/prefill": lambda: _hc_case("collapse", PREFILL, 1),
    "hc_mixes/decode8": lambda: _hc_case("mixes", 1, 8),
    "hc_mixes/prefill": lambda: _hc_case("mixes", PREFILL, 1),
    "hc_sum/decode8": lambda: _hc_case("sum", 1, 8),
    "hc_sum/prefill": lambda: _hc_case("sum", PREFILL, 1),
    "hc_expand/decode8": lambda: _hc_case("expand", 1, 8),
    "hc_expand/prefill": lambda: _hc_case("expand", PREFILL, 1),
    "block_diagonal_matmul/output-decode8": lambda: _output_case(8),
    "block_diagonal_matmul/output-prefill": lambda: _output_case(PREFILL),
    "query_norm_rope/decode8": lambda: _query_case(8),
    "query_norm_rope/prefill": lambda: _query_case(PREFILL),
}


def _tpu_facts(compiled) -> dict:
    """The Mosaic custom call's scoped VMEM and declared cost, from the compiled HLO."""
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        vmem = sum(int(size) for space, size in
                   re.findall(r'\{"memory_space":"(\d+)","offset":"\d+","size":"(\d+)"\}',
                              line.split('"used_scoped_memory_configs"', 1)[1])
                   if space == "1")
        declared = json.loads(re.search(r'"cost_estimate":(\{[^}]*\})', line).group(1))
        return {"vmem_bytes": vmem, "declared_cost": {"flops": int(declared["flops"]),
                                                      "bytes_accessed": int(declared["bytes_accessed"])}}
    raise RuntimeError("no tpu_custom_call in the compiled program")


def _mosaic_gpu_facts(dump_dir: str) -> dict:
    """SMEM, registers and spills of the one Mosaic GPU kernel whose dumps are in dump_dir."""
    logs = [f for f in os.listdir(dump_dir) if f.endswith(".ptxas")]
    passes = [f for f in os.listdir(dump_dir) if f.endswith(".mlir-passes.log")]
    if not logs and not passes:
        raise RuntimeError("Mosaic GPU wrote no dump: it compiled this kernel earlier in this process and "
                           "reused it (a cache that cannot be cleared); run the report in a fresh process")
    if len(logs) != 1 or len(passes) != 1:
        raise RuntimeError(f"expected one kernel's ptxas log and MLIR dump in {dump_dir}, found {sorted(os.listdir(dump_dir))}")
    log = open(os.path.join(dump_dir, logs[0])).read()
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    mlir = open(os.path.join(dump_dir, passes[0])).read()
    smem = re.findall(r"dynamic_shared_memory_size %c(\d+)_i32", mlir)
    return {"smem_bytes": int(smem[-1]) if smem else 0, "registers": int(regs.group(1)),
            "spill_bytes": {"stores": int(spills.group(1)), "loads": int(spills.group(2))},
            "arch": re.search(r"for '(sm_\w+)'", log).group(1)}


# XLA's LLVM optimization of a Triton kernel's PTX changes its registers (e.g. 67 vs 61 for the FP8
# matmul at decode8), so the GPU compiles state XLA's defaults: XLA_FLAGS may lower them (the test
# suite's conftest does, for XLA:CPU's compile time) and the report shows what a default compile makes.
XLA_GPU_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}


def _triton_facts(compiled, kernel: str, xla_dump: str) -> dict:
    """Launch, SMEM, registers, spills and declared cost of the Pallas-Triton kernel `kernel`
    in a program XLA compiled with xla_dump_to=xla_dump."""
    calls = [line for line in compiled.as_text().splitlines() if f'custom_call_target="{aot.TRITON_CALL}"' in line]
    declared = DECLARED_COST.search(calls[0]) if len(calls) == 1 else None
    if declared is None:
        raise RuntimeError(f"expected one Triton call with a declared_cost_<flops>_<bytes> op_name, found {calls}")
    # The launch: "NNN: kCustomKernel [...] <kernel> grid: [x, y, z] threads: [x, y, z]  shared_memory: B bytes".
    launches = []
    for f in os.listdir(xla_dump):
        if f.endswith("thunk_sequence.txt"):
            launches += re.findall(rf"kCustomKernel \[[^\]]*\] {re.escape(kernel)} grid: \[([\d, ]+)\] "
                                   rf"threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes",
                                   open(os.path.join(xla_dump, f)).read())
    if len(launches) != 1:
        raise RuntimeError(f"expected one launch of {kernel} in the thunk sequence in {xla_dump}, found {launches}")
    grid, threads, smem = launches[0]
    entry = re.compile(rf"^(\.visible\s+)?\.entry\s+{re.escape(kernel)}\(", re.M)
    ptx = [f for f in sorted(os.listdir(xla_dump))
           if f.endswith(".ptx") and entry.search(open(os.path.join(xla_dump, f)).read())]
    if len(ptx) != 1:
        raise RuntimeError(f"expected one PTX file with `.entry {kernel}` in {xla_dump}, found {ptx}")
    path = os.path.join(xla_dump, ptx[0])
    arch = re.search(r"^\.target (sm_\w+)", open(path).read(), re.M).group(1)
    ptxas = shutil.which("ptxas")  # dsv4_jax.tools.aot put the one XLA uses first on PATH
    if ptxas is None:
        raise RuntimeError("no ptxas on PATH (the `aot` extra's nvidia-cuda-nvcc-cu12 provides it)")
    run = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", os.devnull, path], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed on {path}: {run.stderr[-2000:]}")
    # ptxas -v reports each entry after "Compiling entry function '<name>' for '<arch>'".
    log = (run.stdout + run.stderr).split(f"Compiling entry function '{kernel}'", 1)[1]
    log = log.split("Compiling entry function", 1)[0]
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"smem_bytes": int(smem), "registers": int(regs.group(1)),
            "spill_bytes": {"stores": int(spills.group(1)), "loads": int(spills.group(2))},
            "arch": re.search(r"for '(sm_\w+)'", log).group(1),
            "grid": [int(v) for v in grid.split(",")], "threads": [int(v) for v in threads.split(",")],
            "declared_cost": {"flops": int(declared.group(1)), "bytes_accessed": int(declared.group(2))}}


def report(targets=TARGETS) -> list[dict]:
    records = []
    for target in targets:
        platform = aot.target(target).platform
        for name, make in CASES.items():
            case = make()
            if isinstance(case["fn"], dict) and platform not in case["fn"]:
                continue
            fn = case["fn"][platform] if isinstance(case["fn"], dict) else case["fn"]
            with tempfile.TemporaryDirectory() as dump:
                mosaic_dump, xla_dump = os.path.join(dump, "mosaic"), os.path.join(dump, "xla")
                options = None
                if platform == "cuda":  # Mosaic GPU reads the variables when it compiles; XLA dumps Triton's PTX
                    os.makedirs(mosaic_dump)
                    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=mosaic_dump)
                    options = {"xla_dump_to": xla_dump, "xla_dump_hlo_pass_re": "NONE", **XLA_GPU_DEFAULTS}
                try:
                    result = aot.compile_for(target, jax.jit(fn), *case["args"], compiler_options=options)
                finally:
                    for var in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO"):
                        os.environ.pop(var, None)
                kernels = aot.kernel_calls(result.compiled, platform)
                if len(kernels) != 1:
                    raise RuntimeError(f"{target} {name}: expected one Pallas kernel, found {kernels}")
                record = {"target": target, "case": name, "kernel": kernels[0], "shapes": case["shapes"],
                          "minimum_bytes": case["minimum_bytes"], "program_memory": result.memory}
                if platform == "tpu":
                    record.update(_tpu_facts(result.compiled))
                    record["xla_cost"] = {"flops": result.cost["flops"],
                                          "bytes_accessed": result.cost["bytes accessed"]}
                elif f'custom_call_target="{aot.TRITON_CALL}"' in result.compiled.as_text():
                    record.update(_triton_facts(result.compiled, kernels[0], xla_dump))
                else:
                    record.update(_mosaic_gpu_facts(mosaic_dump))
            records.append(record)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv4_jax.tools.kernel_report", description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated compile targets")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in aot.TARGETS]
    if unknown or not targets:  # before any compile
        parser.error(f"unknown compile targets {unknown}; known: {', '.join(aot.TARGETS)}")
    json.dump(report(targets), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
