"""`python -m pallas_kernels.report`: the compiler facts it prints (JSON) are read from real
compiles (libtpu for v5p; Mosaic GPU + ptxas for the H100) and hang together. Run as the
command, in its own process: Mosaic GPU dumps a kernel's ptxas log only when it compiles it,
once per process, and other tests compile the same kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pallas_kernels import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "pallas_kernels.report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_report_prints_compiler_facts():
    run = _run("--targets", "v5p-8,h100x1")
    assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads(run.stdout)
    gpu_cases = [c for c, make in report.CASES.items() if "cuda" in make().get("platforms", ("cuda",))]
    assert [(r["target"], r["case"]) for r in records] == ([("v5p-8", c) for c in report.CASES]
                                                           + [("h100x1", c) for c in gpu_cases])
    assert len(gpu_cases) < len(report.CASES)  # the FP8 matmul: TPU only
    by = {(r["target"], r["case"]): r for r in records}
    for r in records:
        assert r["kernel"] == "dsv4_" + r["case"].split("/")[0]
        assert r["minimum_bytes"] > 0 and r["program_memory"]["output_bytes"] > 0

    # Flash decode attention: 640 indices, 640 bf16 rows of 512, q and out [64, 512] bf16.
    tpu, gpu = by["v5p-8", "sparse_attention/flash-decode"], by["h100x1", "sparse_attention/flash-decode"]
    assert tpu["minimum_bytes"] == 640 * 4 + 640 * 512 * 2 + 2 * 64 * 512 * 2
    # TPU: XLA's cost of the program takes the kernel's declared flops and adds the wrapper's bytes;
    # the kernel's VMEM holds at least its double-buffered row tile (2 x 128 x 512 words).
    assert tpu["xla_cost"]["flops"] == tpu["declared_cost"]["flops"] == 4 * 64 * 640 * 512
    assert tpu["xla_cost"]["bytes_accessed"] >= tpu["declared_cost"]["bytes_accessed"] > tpu["minimum_bytes"]
    assert tpu["vmem_bytes"] >= 2 * 128 * 512 * 4
    # GPU: sm_90a, the SMEM holds at least q [64, 512] bf16 and the 16-row buffer; no spills.
    assert gpu["arch"] == "sm_90a"
    assert gpu["smem_bytes"] >= 64 * 512 * 2 + 16 * 512 * 2
    assert 0 < gpu["registers"] <= 255 and gpu["spill_bytes"] == {"stores": 0, "loads": 0}
    for case in report.CASES:
        assert by["v5p-8", case]["vmem_bytes"] > 0 and (case not in gpu_cases or by["h100x1", case]["registers"] > 0)
    # The FP8 matmul declares at least the stored weight (values and scales), x and the output,
    # and at decode the program moves no more than that: the weight is read once.
    for case in ("fp8_matmul/wq_b-decode", "fp8_matmul/wq_a-prefill"):
        r = by["v5p-8", case]
        assert r["xla_cost"]["bytes_accessed"] >= r["declared_cost"]["bytes_accessed"] >= r["minimum_bytes"]
    decode = by["v5p-8", "fp8_matmul/wq_b-decode"]
    assert decode["minimum_bytes"] == 32768 * 1024 + 4 * 256 * 8 + 2 * (1024 + 32768)
    assert decode["xla_cost"]["bytes_accessed"] <= 1.01 * decode["minimum_bytes"]


def test_report_rejects_an_unknown_target():
    run = _run("--targets", "v5p-8,v7x-8")
    assert run.returncode == 2 and run.stdout == ""
    assert "unknown compile targets ['v7x-8']" in run.stderr
