"""`python -m dsv4_jax.tools.bench_speculative --quick`: the JSON it prints, and its counts, which follow
from the forced drafts (it also checks itself that every run's tokens equal the run without
speculation); bad flags are one line and exit 1."""

import json
import math

import pytest

from dsv4_jax.tools import bench_speculative


def test_quick_run(tmp_path, capsys):
    out = tmp_path / "spec.json"
    # one batch of two rows: a row's counts times B show the per-row sums (batch 1 would only repeat them)
    assert bench_speculative.main(["--quick", "--batches", "2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    k, n = printed["k"], printed["sizes"]["new_tokens"]
    assert set(printed["batches"]) == {"2"}
    for B, runs in printed["batches"].items():
        B = int(B)
        assert set(runs) == {"no speculation", "forced 100%", "forced 70%", "MTP block (random weights)"}
        assert runs["no speculation"]["main_model_steps"] == n - 1
        right = runs["forced 100%"]
        # every draft kept: k + 1 tokens a round after the prefill's first token
        assert right["rounds"] == math.ceil((n - 1) / (k + 1)) and right["acceptance_rate"] == 1.0
        assert right["spec_decode_num_drafts"] == B * right["rounds"]
        assert [right[f"spec_decode_num_accepted_tokens_pos_{i}"] for i in range(k)] == [B * right["rounds"]] * k
        assert right["tokens_per_step_per_row"] == pytest.approx((n - 1) / right["rounds"])
        some = runs["forced 70%"]
        assert right["rounds"] <= some["rounds"] <= n - 1 and 0 < some["acceptance_rate"] < 1
        for r in runs.values():
            assert r["tokens_per_s"] > 0 and r["seconds"] > 0


@pytest.mark.parametrize("args", [["--k", "0"], ["--k", "9"], ["--batches", "0"], ["--batches", "x"]])
def test_bad_flags(args, capsys):
    assert bench_speculative.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("bench_speculative: error: ") and err.count("\n") == 1
