"""Capacity of the paged cache (issue 28): `dsv4_jax.tools.capacity_report` measuring the paged engine
against the slot engine in the same cache memory, and one engine holding a request near its
longest context beside many short ones at once, each as it runs alone.

fp32 throughout, as tests/test_paged_cache.py (whose model and `_alone` this reuses)."""

from __future__ import annotations

import json

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax.model.cache import block_bytes, blocks_per_row  # noqa: E402
from dsv4_jax.runtime.engine import Engine  # noqa: E402
from dsv4_jax.tools import capacity_report  # noqa: E402
from test_paged_cache import CFG, _alone  # noqa: E402


def test_capacity_report_on_the_tiny_preset(capsys):
    """4 MiB of cache, 384-token requests (3 blocks; one prefill chunk each), the baseline's slots
    at 2048 tokens (16 blocks): the paged engine runs as many requests at once as its budget
    holds, more than the baseline, both within M, and every request finishes."""
    M = 4 << 20
    assert capacity_report.main(["--preset", "tiny", "--dtype", "float32", "--memory", "4MiB", "--seq-len", "384",
                                 "--baseline-max-len", "2048", "--max-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    base, paged = out["baseline"], out["paged"]
    assert base["num_blocks"] == base["slots"] * blocks_per_row(2048, 128)
    assert paged["max_len"] == base["max_len"] == 2048
    for e in (base, paged):
        a = e["allocated_bytes"]
        assert a["per_slot_arrays"] + a["pools"] == a["total"] <= M
        assert e["finished"] == out["requests"] and e["preemptions"] == 0
        assert e["peak_running"] == e["slots"]  # every slot busy: more requests than slots
    assert out["requests"] > paged["slots"] > base["slots"] >= 1
    # what the paged budget holds: its slots' 3 blocks each (and one max_len sequence's 16); a
    # slot more would not fit
    a = paged["allocated_bytes"]
    per_slot, per_block = a["per_slot_arrays"] / paged["slots"], a["pools"] / paged["num_blocks"]
    assert paged["num_blocks"] >= max(3 * paged["slots"], 16)
    assert (paged["slots"] + 1) * per_slot + max(3 * (paged["slots"] + 1), 16) * per_block > M
    assert out["ratio"] == paged["peak_running"] / base["peak_running"] > 1
    assert out["computed"]["flash"]["ratio_limit"] > 1


@pytest.mark.parametrize("argv, message", [
    (["--memory", "1MiB", "--seq-len", "256", "--baseline-max-len", "2048"], "holds no baseline sequence"),
    (["--memory", "4MiB", "--seq-len", "4096", "--baseline-max-len", "2048"], "--seq-len 4096 exceeds"),
    (["--memory", "4MiB", "--preset", "huge"], "--preset must be one of"),
    (["--memory", "lots"], "is not a size"),
])
def test_capacity_report_bad_input_is_one_line(capsys, argv, message):
    assert capacity_report.main(["--dtype", "float32", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("capacity_report: error:") and message in err, err


@pytest.fixture(scope="module")
def model():
    return dsv4_jax.DeepseekV4(dsv4_jax.init_params(CFG, seed=2, std=0.1), CFG)


def test_a_long_request_runs_beside_many_short_ones(model):
    """max_len 1024 and pools of 14 blocks of 128 tokens for 7 slots (a slot engine at max_len
    needs 56): one request of 880 + 120 tokens (8 blocks) and six of 40 + 24 (one block each) all
    run at once, each getting the tokens it gets alone."""
    per = block_bytes(CFG, 128, jnp.float32)
    eng = Engine(model, slots=7, max_len=1024, prefill_chunk=64, kv_cache_memory=14 * per)
    assert eng.num_blocks == 14 < eng.slots * blocks_per_row(1024, 128)
    rng = np.random.default_rng(8)
    long_prompt = rng.integers(0, CFG.vocab_size, 880).tolist()
    short_prompts = [rng.integers(0, CFG.vocab_size, 40).tolist() for _ in range(6)]
    long = eng.submit(long_prompt, 120)
    shorts = [eng.submit(p, 24) for p in short_prompts]
    together = 0  # the most short requests generating in a step where the long one generates too
    while eng.step() or eng.waiting:
        running = list(eng.running.values())
        assert len(running) <= eng.slots and eng.pool.used <= eng.num_blocks
        if long in running and long.tokens:
            together = max(together, sum(r in running and len(r.tokens) > 0 for r in shorts))
    assert together == 6
    assert eng.counters["preemptions"] == 0
    assert len(long_prompt) + len(long.tokens) == 1000 and long.finish_reason == "length"
    # generate's cache at the engine's max_len: one set of programs for every request alone
    assert long.tokens == _alone(model, long_prompt, 120, max_len=1024)
    for r, p in zip(shorts, short_prompts):
        assert r.finish_reason == "length" and r.tokens == _alone(model, p, 24, max_len=1024)
