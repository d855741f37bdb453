"""dsv4_jax.tools.bench: the JSON it prints has every field, with sane positive numbers (no timing
thresholds: timings on a shared 2-core machine are not test material)."""

import json
import math
import os
import subprocess
import sys

import pytest

from dsv4_jax.tools import bench
from dsv4_jax.tools.hf_reference import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "dsv4_jax.tools.bench", "--quick", "--skip-transformers", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert json.loads(out.read_text()) == printed
    return printed


def test_quick_json_has_every_field(quick):
    r = quick
    assert r["model"] == "quick" and r["transformers"].startswith("skipped")
    assert r["env"]["jax_default_matmul_precision"] is not None and r["env"]["cpu_count"] >= 1
    assert _positive(r["params"]) and r["hf_config"]["compress_ratios"] == [0, 4, 128]
    ours = r["ours"]
    assert _positive(ours["prefill"]["tokens_per_s"]) and ours["prefill"]["tokens"] == r["sizes"]["prefill_len"]
    for b in r["sizes"]["batches"]:
        d = ours[f"decode_b{b}"]
        assert d["batch"] == b and _positive(d["tokens_per_s"]) and _positive(d["ms_per_step"])
        assert _positive(ours["compile_s"][f"decode_loop_b{b}"])
    assert ours["compile_s"]["prefill"] and all(_positive(v) for v in ours["compile_s"]["prefill"].values())
    assert sorted(map(int, ours["decode_step"])) == sorted(r["sizes"]["contexts"])
    for v in ours["decode_step"].values():
        assert _positive(v["ms"]) and _positive(v["compile_s"]) and v["steps_timed"] >= 1
    assert _positive(ours["decode_step_growth_16k_over_1k"])
    assert set(r["goals"]) == set(bench.GOALS)
    g = r["goals"]["decode_step_16k_over_1k"]
    assert _positive(g["measured"]) and isinstance(g["pass"], bool)
    assert r["goals"]["prefill_2048_speedup"]["pass"] is None  # needs transformers
    assert isinstance(r["notes"], list) and r["notes"]
    lim = r["limits"]
    assert _positive(lim["stream_GB_per_s"]) and _positive(lim["matmul_fp32_GFLOP_per_s"])
    assert _positive(lim["prefill_GFLOP"]) and _positive(lim["prefill_floor_s"])
    floors = [lim[f"decode_b{b}_step_floor_ms"] for b in r["sizes"]["batches"]]
    assert all(map(_positive, floors)) and floors == sorted(floors)  # more rows read more experts
    assert lim["decode_b1_experts_read_per_layer"] == r["hf_config"]["num_experts_per_tok"]


def test_limits_count_the_weights_a_step_reads():
    """The floors are the bytes / FLOPs counted from the params over the measured rates: check
    the counts against a hand count on the quick model."""
    import jax

    from dsv4_jax.model.config import ModelConfig
    from dsv4_jax.model.params import init_params

    cfg = ModelConfig.from_hf(bench.QUICK_MODEL)
    params = init_params(cfg, seed=0)
    sizes = dict(bench.QUICK_SIZES, batches=(1, 4))
    lim = bench.machine_limits(params, cfg, sizes)
    E, k, L = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers
    one_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    non_expert = total - L * E * one_expert - params["embed"].nbytes
    assert lim["weights_MB"]["one_expert_one_layer"] == pytest.approx(one_expert / 1e6)
    assert lim["weights_MB"]["non_expert"] == pytest.approx(non_expert / 1e6)
    gbps = lim["stream_GB_per_s"] * 1e9
    assert lim["decode_b1_step_floor_ms"] == pytest.approx(1e3 * (non_expert + L * k * one_expert) / gbps)
    experts4 = E * (1 - ((E - k) / E) ** 4)
    assert lim["decode_b4_experts_read_per_layer"] == pytest.approx(experts4)
    assert lim["decode_b4_step_floor_ms"] == pytest.approx(1e3 * (non_expert + L * experts4 * one_expert) / gbps)
    assert lim["prefill_floor_s"] == pytest.approx(lim["prefill_GFLOP"] / lim["matmul_fp32_GFLOP_per_s"])


def test_transformers_side_and_ratios_on_a_tiny_model():
    """The transformers half (and the ratio / goal plumbing) on a tiny model: a few seconds."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    d = dict(bench.QUICK_MODEL, vocab_size=64, hidden_size=32, moe_intermediate_size=16, head_dim=32,
             qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=8, sliding_window=8, index_head_dim=16, index_topk=4)
    sizes = dict(bench.QUICK_SIZES, prefill_len=32, prompt_len=8, new_tokens=2, hf_contexts=(16,), hf_new_tokens=(3,))
    hf = make_model(d, seed=0)
    threads, probe = bench._torch_threads(hf, 2, None, d["vocab_size"])
    assert threads in (1, 2) and probe["chosen"] == threads and _positive(probe["decode_step_ms_1_threads"])
    assert bench._torch_threads(hf, 2, 3, d["vocab_size"])[0] == 3
    out = bench.bench_transformers(hf, sizes, d["vocab_size"])
    assert _positive(out["prefill"]["tokens_per_s"])
    for b in sizes["batches"]:
        assert _positive(out[f"decode_b{b}"]["tokens_per_s"])
    assert _positive(out["decode_step"]["16"]["ms"])

    fake = {"prefill": {"tokens_per_s": 2 * out["prefill"]["tokens_per_s"]},
            "decode_step": {"16": {"ms": out["decode_step"]["16"]["ms"] / 4}}}
    for b in sizes["batches"]:
        fake[f"decode_b{b}"] = {"tokens_per_s": 3 * out[f"decode_b{b}"]["tokens_per_s"]}
    ratios = bench._ratios(fake, out)
    assert ratios["prefill_tokens_per_s"] == pytest.approx(2)
    assert ratios["decode_tokens_per_s_b1"] == pytest.approx(3)
    assert ratios["decode_step_speedup"]["16"] == pytest.approx(4)
    goals = bench._goals({"ratios": ratios, "ours": {"decode_step_growth_16k_over_1k": 1.0},
                          "sizes": {"batches": list(sizes["batches"])}}, quick=True)
    assert goals["decode_b1_speedup"]["pass"] is True and goals["prefill_2048_speedup"]["pass"] is False
    assert goals["decode_b8_speedup"]["measured"] == pytest.approx(3)  # quick: the largest batch
    assert goals["decode_step_16k_over_1k"]["pass"] is True
    assert "ceiling_here" not in goals["decode_b1_speedup"]  # no limits measured

    # ceilings: transformers' time over our floor, and whether each goal fits under it
    limits = {"prefill_floor_s": out["prefill"]["seconds"] / 10}
    for b in sizes["batches"]:
        limits[f"decode_b{b}_step_floor_ms"] = out[f"decode_b{b}"]["ms_per_step"] / (2 if b == 1 else 9)
    result = {"ratios": ratios, "ours": {"decode_step_growth_16k_over_1k": 1.0}, "limits": limits,
              "transformers": out, "sizes": {"batches": list(sizes["batches"])}}
    result["ceilings"] = bench._ceilings(result)
    assert result["ceilings"]["prefill_tokens_per_s"] == pytest.approx(10)
    goals = bench._goals(result, quick=True)
    assert goals["decode_b1_speedup"]["ceiling_here"] == pytest.approx(2)
    assert goals["decode_b1_speedup"]["reachable_here"] is False  # 2.5x asked, 2x possible
    assert goals["decode_b8_speedup"]["reachable_here"] is True and goals["prefill_2048_speedup"]["reachable_here"]
