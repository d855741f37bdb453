"""`python -m dsv4_jax.tools.kernel_report`: the compiler facts it prints (JSON) are read from real
compiles (libtpu for v5p; Mosaic GPU + ptxas, and XLA's Triton compile + ptxas, for the H100)
and hang together. Run as the command, in its own process: Mosaic GPU dumps a kernel's ptxas log
only when it compiles it, once per process, and other tests compile the same kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pallas_kernels import fp8_activations_gpu as fag
from pallas_kernels import grouped_matmul_gpu as gmg
from pallas_kernels import hyper_connection_gpu as hcg
from pallas_kernels import indexer_scores_gpu as isg
from pallas_kernels import indexer_scores_tpu as ist
from pallas_kernels import quantized_matmul_gpu as qmg
from pallas_kernels import query_gpu as qg
from dsv4_jax.tools import kernel_report as report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "dsv4_jax.tools.kernel_report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_report_prints_compiler_facts():
    run = _run("--targets", "v5p-8,h100x1")
    assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads(run.stdout)
    tpu_only = [c for c in report.CASES if c.startswith("hc_collapse/")]  # on CUDA two kernels, two cases:
    gpu_only = [c for c in report.CASES
                if c.split("/")[0] in ("hc_mixes", "hc_sum", "query_norm_rope")
                or (c.startswith("indexer_scores/") and not c.endswith("-fp8"))]
    hyper = [c for c in report.CASES if c.startswith("hc_")]
    assert [(r["target"], r["case"]) for r in records] == [(t, c) for t in ("v5p-8", "h100x1") for c in report.CASES
                                                           if c not in (gpu_only if t == "v5p-8" else tpu_only)]
    by = {(r["target"], r["case"]): r for r in records}
    matmuls = [c for c in report.CASES
               if c.split("/")[0] in ("fp8_matmul", "grouped_matmul", "grouped_swiglu", "fp8_activation_matmul")]
    fp8_records = [c for c in report.CASES if c.startswith("sparse_attention/") and c.endswith("-fp8")]
    block_diagonal = [c for c in report.CASES if c.startswith("block_diagonal_matmul/")]  # the grouped kernels' form
    scores = [c for c in report.CASES if c.startswith("indexer_scores/")]
    for r in records:  # on CUDA the matmuls are the Pallas-Triton kernels, "..._gpu", and so is
        # the attention over FP8 records, "..._fp8"
        triton = r["target"] == "h100x1" and r["case"] in (matmuls + fp8_records + gpu_only + hyper + block_diagonal
                                                           + scores)
        suffix = ("_fp8" if r["case"] in fp8_records else "_gpu") if triton else ""
        kernel = "grouped_matmul" if r["case"] in block_diagonal else r["case"].split("/")[0]
        assert r["kernel"] == "dsv4_" + kernel + suffix
        assert r["minimum_bytes"] > 0 and r["program_memory"]["output_bytes"] > 0
        assert ("grid" in r) == triton

    # Flash decode attention: 640 indices, 640 bf16 rows of 512, q and out [64, 512] bf16, the
    # query's cos and sin (32 fp32 each).
    tpu, gpu = by["v5p-8", "sparse_attention/flash-decode"], by["h100x1", "sparse_attention/flash-decode"]
    assert tpu["minimum_bytes"] == 640 * 4 + 640 * 512 * 2 + 2 * 64 * 512 * 2 + 2 * 32 * 4
    # TPU: XLA's cost of the program takes the kernel's declared flops and adds the wrapper's (a
    # few on the rope's lanes, fewer than q's elements) and bytes; the kernel's VMEM holds at least
    # its double-buffered row tile (2 x 128 x 512 words).
    assert tpu["declared_cost"]["flops"] == 4 * 64 * 640 * 512
    assert 0 <= tpu["xla_cost"]["flops"] - tpu["declared_cost"]["flops"] < 64 * 512
    assert tpu["xla_cost"]["bytes_accessed"] >= tpu["declared_cost"]["bytes_accessed"] > tpu["minimum_bytes"]
    assert tpu["vmem_bytes"] >= 2 * 128 * 512 * 4
    # GPU: sm_90a, the SMEM holds at least q [64, 512] bf16 and the 16-row buffer; no spills.
    assert gpu["arch"] == "sm_90a"
    assert gpu["smem_bytes"] >= 64 * 512 * 2 + 16 * 512 * 2
    assert 0 < gpu["registers"] <= 255 and gpu["spill_bytes"] == {"stores": 0, "loads": 0}
    # Over FP8 records the kernels declare each selected record's 584 bytes once (within 10 % of
    # the minimum), on TPU under half of what they declare for bf16 rows (a bf16 row travels in a
    # word pair with its neighbour: 2,048 bytes); no spills on the H100.
    tpu8, gpu8 = by["v5p-8", "sparse_attention/flash-decode-fp8"], by["h100x1", "sparse_attention/flash-decode-fp8"]
    assert tpu8["minimum_bytes"] == 640 * 4 + 640 * 584 + 2 * 64 * 512 * 2 + 2 * 32 * 4
    assert tpu8["declared_cost"]["bytes_accessed"] < tpu["declared_cost"]["bytes_accessed"] / 2
    for r in (tpu8, gpu8):
        assert r["minimum_bytes"] <= r["declared_cost"]["bytes_accessed"] < 1.1 * r["minimum_bytes"]
    assert gpu8["spill_bytes"] == {"stores": 0, "loads": 0}
    for case in report.CASES:
        assert case in gpu_only or by["v5p-8", case]["vmem_bytes"] > 0
        assert case in tpu_only or by["h100x1", case]["registers"] > 0
    # The hyper-connections' kernels declare at least the streams, fn, the per-token weights and
    # the outputs; the program around them moves less than half the streams' bytes more (the small
    # per-token weights re-laid out), so the streams themselves are not re-laid out.
    for case in hyper:
        if case not in gpu_only:
            r = by["v5p-8", case]
            streams = r["shapes"]["B"] * r["shapes"]["S"] * 4 * 4096 * 2
            assert r["declared_cost"]["bytes_accessed"] >= r["minimum_bytes"]
            assert r["xla_cost"]["bytes_accessed"] - r["declared_cost"]["bytes_accessed"] < streams / 2
        if case not in tpu_only:  # on the H100: a program per 16 tokens and column chunk of a
            # stream (the mixes) or per token and 1,024 columns (the sum, the expansion); no spills
            r = by["h100x1", case]
            n = r["shapes"]["B"] * r["shapes"]["S"]
            grid = [-(-n // 16), 4 * 4096 // hcg.MIXES_BK, 1] if case.startswith("hc_mixes") else [n, 4, 1]
            assert r["grid"] == grid and r["arch"] == "sm_90a"
            assert 0 < r["registers"] <= 255 and r["spill_bytes"] == {"stores": 0, "loads": 0}
            assert r["declared_cost"]["bytes_accessed"] >= r["minimum_bytes"]
    # The FP8 matmuls declare at least the stored weight (values and scales), x and the output,
    # and at decode the program moves no more than that: the weight is read once.
    # (The experts' fused first half too: both weights' chosen experts, the routing weights.)
    for case in ("fp8_matmul/wq_b-decode", "fp8_matmul/4096x4096-decode8", "fp8_matmul/wq_a-prefill",
                 "fp8_activation_matmul/4096x4096-decode8", "fp8_activation_matmul/wq_a-prefill",
                 "grouped_swiglu/fp4-decode", "grouped_swiglu/fp4-prefill"):
        r = by["v5p-8", case]
        assert r["xla_cost"]["bytes_accessed"] >= r["declared_cost"]["bytes_accessed"] >= r["minimum_bytes"]
    decode = by["v5p-8", "fp8_matmul/wq_b-decode"]
    assert decode["minimum_bytes"] == 32768 * 1024 + 4 * 256 * 8 + 2 * (1024 + 32768)
    assert decode["xla_cost"]["bytes_accessed"] <= 1.01 * decode["minimum_bytes"]

    # The Triton kernels (H100): XLA's launch of each (the thunk sequence) is the kernel's own grid
    # and warps (its tiling functions), with shared memory for the pipelined tiles within an
    # H100's 227 KiB per block; ptxas (run on the dumped PTX) gives registers without spills.
    # The declared cost comes from the op_name: the kernel's formula, at least the minimum.
    for case in matmuls:
        r = by["h100x1", case]
        m, n, k = (r["shapes"][d] for d in "MNK")
        if case.startswith("fp8_matmul"):
            tm, tn, _ = qmg.tiles(m, n, "bfloat16")
            assert r["grid"] == [-(-m // tm), -(-n // tn), 1]
            assert r["threads"] == [32 * (8 if tm * tn >= 128 * 128 else 4), 1, 1]
        elif case.startswith("fp8_activation_matmul"):
            tm, tn = fag.tiles(m, n)
            assert r["grid"] == [-(-m // tm), -(-n // tn), 1]
        else:  # the grouped ones (the fused first half: two weights, TN halved at the prefill tiles)
            e, fmt, fused = r["shapes"]["E"], r["shapes"]["weight"], case.startswith("grouped_swiglu")
            tiles = (gmg.swiglu_tiles if fused else gmg.tiles)(m, e, fmt)
            assert r["grid"] == [-(-n // tiles.tn), gmg.max_steps(m, e, tiles.tm), 1]
            assert r["threads"] == [32 * tiles.num_warps, 1, 1]
            declared = gmg.cost_estimate(m, n, k, e, fmt, 2, 1, weights=2 if fused else 1)
            assert r["declared_cost"] == {"flops": declared.flops, "bytes_accessed": declared.bytes_accessed}
        assert r["arch"] == "sm_90a"
        assert 0 < r["smem_bytes"] <= 227 * 1024
        assert 0 < r["registers"] <= 255 and r["spill_bytes"] == {"stores": 0, "loads": 0}
        assert r["declared_cost"]["flops"] >= 2 * m * n * k
        assert r["declared_cost"]["bytes_accessed"] >= r["minimum_bytes"]
    # The indexer's scores (keys as bf16 values or FP8 records; on TPU records only): on the H100
    # a program per (row, query tile, key tile), no spills; on TPU the kernel's grid order's
    # reads. Each declares its formula, at least the minimum, and at decode every byte once (the
    # minimum); over records about 136 / 256 of the bytes over bf16 keys on the H100.
    for case in scores:
        gpu = by["h100x1", case]
        b, t, h, n, d = (gpu["shapes"][x] for x in "BTHND")
        records = gpu["shapes"]["keys"] == "fp8 records"
        tt, tn = isg.tiles(t, "bfloat16")
        assert sorted(gpu["grid"]) == sorted([b, -(-t // tt), -(-n // tn)])
        assert gpu["arch"] == "sm_90a" and 0 < gpu["smem_bytes"] <= 227 * 1024
        assert 0 < gpu["registers"] <= 255 and gpu["spill_bytes"] == {"stores": 0, "loads": 0}
        declared = {"h100x1": isg.cost_estimate(b, t, h, n, d, "bfloat16", 136 if records else None)}
        if records:
            declared["v5p-8"] = ist.cost_estimate(b, t, h, n, d, "bfloat16")
        for target, want in declared.items():
            r = by[target, case]
            assert r["declared_cost"] == {"flops": want.flops, "bytes_accessed": want.bytes_accessed}
            assert r["declared_cost"]["bytes_accessed"] >= r["minimum_bytes"]
            if case.startswith("indexer_scores/decode"):
                assert r["declared_cost"]["bytes_accessed"] == r["minimum_bytes"]
    fp8, bf16 = (by["h100x1", "indexer_scores/decode-1m" + x]["declared_cost"]["bytes_accessed"]
                 for x in ("-fp8", ""))
    assert 0.5 * bf16 < fp8 < 0.55 * bf16
    # The grouped output projection, its heads rotated back as loaded: at least the minimum declared
    # (wo_a's blocks, x, the output, the rows' cos and sin), no spills on the H100, and on TPU the
    # program moves no more than 10 % beyond the kernel's own (x is read in place, not re-laid out).
    for case in block_diagonal:
        tpu, gpu = by["v5p-8", case], by["h100x1", case]
        for r in (tpu, gpu):
            assert r["declared_cost"]["bytes_accessed"] >= r["minimum_bytes"]
        assert tpu["xla_cost"]["bytes_accessed"] <= 1.1 * tpu["declared_cost"]["bytes_accessed"]
        assert gpu["arch"] == "sm_90a" and 0 < gpu["smem_bytes"] <= 227 * 1024
        assert 0 < gpu["registers"] <= 255 and gpu["spill_bytes"] == {"stores": 0, "loads": 0}
    # The queries' norm and rotation: a program per ROWS rows (heads of tokens), every byte once
    # (the minimum), no spills.
    for case in [c for c in gpu_only if c.startswith("query_norm_rope/")]:
        r = by["h100x1", case]
        assert r["grid"] == [-(-r["shapes"]["T"] * r["shapes"]["H"] // qg.ROWS), 1, 1] and r["arch"] == "sm_90a"
        assert 0 < r["registers"] <= 255 and r["spill_bytes"] == {"stores": 0, "loads": 0}
        assert r["declared_cost"]["bytes_accessed"] == r["minimum_bytes"]
    # FP8 at decode (8 rows: one row tile, 256 column tiles): HBM bytes are the minimum, the weight
    # once, x once (its re-reads by the column tiles come from L2), the output once.
    decode8 = by["h100x1", "fp8_matmul/4096x4096-decode8"]
    assert decode8["grid"] == [1, 256, 1]
    assert decode8["minimum_bytes"] == 4096 * 4096 + 4 * 32 * 32 + 2 * (8 * 4096 + 8 * 4096)
    assert decode8["declared_cost"] == {"flops": 2 * 8 * 4096 * 4096, "bytes_accessed": decode8["minimum_bytes"]}


def test_report_rejects_an_unknown_target():
    run = _run("--targets", "v5p-8,v7x-8")
    assert run.returncode == 2 and run.stdout == ""
    assert "unknown compile targets ['v7x-8']" in run.stderr
