"""dsv4-plan (dsv4_jax/tools/plan.py) on small configs: a few layers of Flash's shapes (its head_dim 512,
rope 64, index heads of 128, window 128, every layer kind, FP8 linears and FP4 experts, narrower
widths and fewer experts so that it compiles in seconds), planned for one target with the
max_context search; a model too big for one H100; and bad input. The full-size plans (minutes
each) are in docs/plan.md, not here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import pytest

from dsv4_jax.tools import aot, plan
from dsv4_jax.model.presets import FLASH, preset

SMALL = dict(FLASH, vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             q_lora_rank=128, o_groups=2, o_lora_rank=128, index_n_heads=4, n_routed_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=256, num_hash_layers=1,
             compress_ratios=[0, 4, 128, 4, 0])
# Too big for one 80 GB H100 whatever its context: a 2^25-token vocabulary (a bf16 embedding and
# head of 2^25 x 1024: 128 GiB), the layers of SMALL.
HUGE_VOCAB = dict(SMALL, vocab_size=1 << 25, hidden_size=1024)


def _config(tmp_path, d, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_plan_small_flash(tmp_path, capsys):
    """The JSON's keys and their meaning on v5p-8 (dp_attention over expert=4, one sequence per
    device): parameter bytes are this device's shards (its quarter of the routed experts), the
    step's bytes accessed are at least its minimum, the roofline is the larger of the two bounds,
    and max_context, compiled to check it, fits while the memory the search measured grows with
    the length."""
    cfg = _config(tmp_path, SMALL, "small")
    assert plan.main([cfg, "--target", "v5p-8", "--max-len", "1024", "--prefill-chunk", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == {"expert": 4} and out["layout"] == "dp_attention" and out["batch"] == 4
    pd = out["per_device"]
    assert isinstance(pd["fits"], bool) and pd["fits"]
    assert pd["memory_bytes"] == aot.DEVICES["TPU v5p"].memory_bytes
    assert pd["total_bytes"] == pd["parameter_bytes"] + pd["cache_bytes"] + pd["temp_bytes"] + pd["other_bytes"]
    routed = 4 * 8 * 3 * (256 * 128 + 256 * 8)  # 4 layers x 8 experts x (w1, w2, w3): FP4 values and scales
    s = plan.setup(cfg, "v5p-8", None, None, 4, "native")
    assert pd["parameter_bytes"] == plan.device_bytes(s.params)
    whole = sum(x.size * x.dtype.itemsize for x in __import__("jax").tree.leaves(s.params))
    assert whole - pd["parameter_bytes"] == routed * 3 // 4  # the other three devices' experts
    dev = aot.DEVICES["TPU v5p"]
    for name, tokens in (("decode", 4), ("prefill", 4 * 64)):
        step = out[name]
        for key in ("flops", "bytes_accessed", "min_bytes", "roofline_ms"):
            assert isinstance(step[key], float) and step[key] > 0, (name, key)
        assert step["bytes_accessed"] >= step["min_bytes"]
        assert step["bytes_ratio"] == pytest.approx(step["bytes_accessed"] / step["min_bytes"])
        bound = max(step["bytes_accessed"] / dev.hbm_bandwidth, step["flops"] / dev.peak_bf16_flops)
        assert step["roofline_ms"] == pytest.approx(bound * 1e3)
        assert step["tokens_per_s"] == pytest.approx(tokens / bound)
        # XLA's own analysis counts the layer loop once: ours counts its 4 trips
        assert step["bytes_accessed"] > step["xla_cost_loops_once"]["bytes_accessed"]
    assert out["prefill"]["flops"] > out["decode"]["flops"]
    assert out["max_context"] >= 1024 and out["max_context"] % 128 == 0
    search = out["max_context_search"]
    assert search["verified"] and search["tried"][str(out["max_context"])] <= pd["memory_bytes"]
    lengths = sorted(int(n) for n in search["tried"])
    assert search["tried"][str(lengths[-1])] > search["tried"][str(lengths[0])]


def test_cache_section_with_fp8_records(tmp_path, capsys):
    """--kv-cache-dtype fp8 --seq-len: the compressed entries and the window rings' K=V rows as
    584-byte records (head_dim 512) against bf16's 1,024 bytes, in the cache's shapes; as v5p
    lays the pools out, no fewer bytes (lanes padded); a sequence's bytes are its rings and states
    plus its blocks, and the free memory holds that many laid-out sequences."""
    cfg = _config(tmp_path, SMALL, "small")
    outs = {}
    for kv in ("auto", "fp8"):
        assert plan.main([cfg, "--target", "v5p-8", "--max-len", "1024", "--prefill-chunk", "64", "--seq-len",
                          "4096", "--kv-cache-dtype", kv, "--no-max-context"]) == 0
        outs[kv] = json.loads(capsys.readouterr().out)
    c, b = outs["fp8"]["cache"], outs["auto"]["cache"]
    assert c["kv_cache_dtype"] == "fp8" and c["seq_len"] == 4096
    # a block of 128 tokens: 2 ratio-4 layers x 32 entries + 1 ratio-128 layer x 1, and the indexer's
    # 2 x 32 keys of 128 values (records of 136 bytes against 256)
    keys = 2 * 32
    assert b["block_bytes"] == 65 * 1024 + keys * 256 and c["block_bytes"] == 65 * 584 + keys * 136
    assert c["bf16_bytes_per_sequence"] == b["bytes_per_sequence"]
    # 32 blocks of 4096 tokens, and 4 layers' rings of 128 rows
    assert b["bytes_per_sequence"] - c["bytes_per_sequence"] == (32 * 65 + 4 * 128) * (1024 - 584) + 32 * keys * 120
    # As the compiled step lays them out on a TPU: a pool's last dim padded to 128 lanes of 32-bit
    # words, so an entry's 146 words take 256 (1,024 bytes, as bf16's 512 values) and a key's 34
    # take 128 (512 bytes, twice bf16's); bf16's 512 and 128 values fill their lanes.
    assert b["laid_out_block_bytes"] == b["block_bytes"]
    assert c["laid_out_block_bytes"] == 65 * 1024 + keys * 512
    for x in (b, c):
        assert x["laid_out_bytes_per_sequence"] >= x["bytes_per_sequence"]
        assert x["sequences_per_device"] == x["free_bytes"] // x["laid_out_bytes_per_sequence"] > 0
        assert x["sequences"] == 4 * x["sequences_per_device"]  # dp_attention: one piece per device
    for kv in ("auto", "fp8"):
        pd = outs[kv]["per_device"]
        assert pd["cache_bytes"] >= pd["cache_shape_bytes"]
    assert outs["fp8"]["per_device"]["cache_shape_bytes"] < outs["auto"]["per_device"]["cache_shape_bytes"]
    assert outs["fp8"]["decode"]["min_bytes"] < outs["auto"]["decode"]["min_bytes"]


def test_laid_out_bytes_pad_the_tiled_dims():
    """A TPU layout pads the minor dims to whole tiles (in the layout's order of dims); an
    untiled one (GPU) takes the shape's bytes."""
    from jax.experimental.layout import Layout
    assert plan.laid_out_bytes((2, 32, 146), jnp.uint32, Layout((0, 1, 2), ((8, 128),))) == 2 * 32 * 256 * 4
    assert plan.laid_out_bytes((2, 30, 146), jnp.uint32, Layout((0, 2, 1), ((8, 128),))) == 2 * 152 * 128 * 4
    assert plan.laid_out_bytes((2, 30, 146), jnp.uint32, Layout((0, 1, 2))) == 2 * 30 * 146 * 4


def test_too_big_for_one_h100(tmp_path, capsys):
    cfg = _config(tmp_path, HUGE_VOCAB, "huge")
    assert plan.main([cfg, "--target", "h100x1", "--max-len", "256", "--prefill-chunk", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    pd = out["per_device"]
    assert pd["parameter_bytes"] > pd["memory_bytes"] == aot.DEVICES["H100 SXM"].memory_bytes
    assert pd["fits"] is False and out["max_context"] == 0


@pytest.mark.parametrize("target", ["v5p-8", "h100x1"])
def test_cost_counts_every_loop_trip(target):
    """program_cost on a known program: a scan of 10 matmuls by the layers of a stacked weight
    (XLA's own analysis counts the body once), then a 3-way switch (XLA counts its costliest
    branch), writing 8 rows per layer into a carried buffer (XLA's GPU analysis counts the
    whole buffer for an in-place scatter). Flops within 1%: 10 layer products and the costliest
    branch's; bytes: each layer's weight once, and the scatter's rows, not its 42 MB buffer 10
    times over."""
    import jax
    import jax.numpy as jnp

    def f(w, x, buf, k):
        def body(carry, i):
            x, buf = carry
            x = jnp.tanh(x @ w[i])
            rows = jnp.argmax(x, axis=1)  # data-dependent rows, as a cache write's
            return (x, buf.at[i, rows].set(x)), None

        (x, buf), _ = jax.lax.scan(body, (x, buf), jnp.arange(10))
        return jax.lax.switch(k, [lambda x: x * 2, lambda x: x @ w[0], jnp.sin], x), buf

    args = (jax.ShapeDtypeStruct((10, 1024, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((10, 2048, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32))
    compiled = aot.compile_for(target, jax.jit(f, donate_argnums=2), *args).compiled
    cost = plan.program_cost(compiled.as_text(), 0, None, aot.target(target).platform)
    layer = 2 * 8 * 1024 * 1024
    assert cost["flops"] == pytest.approx(11 * layer, rel=0.01)  # 10 layers + the costliest branch
    assert cost["xla_flops"] == pytest.approx(2 * layer, rel=0.01)
    weights, buffer = 10 * 1024 * 1024 * 2, 10 * 2048 * 1024 * 2
    # a GPU copies each layer's slice out before its product: read, written, read again
    assert weights <= cost["bytes_accessed"] < 4 * weights
    assert {"trips": 10, "assumed": False} in cost["loops"]
    if target == "h100x1":  # uncorrected, XLA's figure holds the whole buffer, read and written, 10 times
        raw = plan.program_cost(compiled.as_text(), 0, None, "tpu")
        assert raw["bytes_accessed"] - cost["bytes_accessed"] == pytest.approx(10 * 2 * buffer, rel=0.01)


@pytest.mark.parametrize("target", ["v5p-8", "h100x1"])
def test_cost_counts_the_rows_a_gather_reads(target, monkeypatch):
    """program_cost on a scan that gathers 64 rows a layer out of a 42 MB stack of 10 layers' rows
    (as the decode step reads its cache pools): bytes under 4x the rows gathered (read, written,
    read by the sum; TPU pads them to its tiles), where XLA's analysis of a GPU program,
    uncorrected, counts the whole stack every layer (of a TPU one, the rows)."""
    import jax
    import jax.numpy as jnp

    def f(stack, ids, x):
        def body(x, i):
            return x + jnp.sum(stack[i, ids[i]].astype(jnp.float32), axis=0), None

        return jax.lax.scan(body, x, jnp.arange(10))[0]

    args = (jax.ShapeDtypeStruct((10, 4096, 512), jnp.bfloat16), jax.ShapeDtypeStruct((10, 64), jnp.int32),
            jax.ShapeDtypeStruct((512,), jnp.float32))
    text = aot.compile_for(target, jax.jit(f), *args).compiled.as_text()
    platform = aot.target(target).platform
    rows, stack = 10 * 64 * 512 * 2, 10 * 4096 * 512 * 2
    assert rows <= plan.program_cost(text, 0, None, platform)["bytes_accessed"] < 4 * rows
    if platform == "cuda":
        monkeypatch.setattr(plan, "_gather_overcount", lambda mod, line: 0.0)
        assert plan.program_cost(text, 0, None, platform)["bytes_accessed"] > 10 * stack


@pytest.mark.parametrize("target", ["v5p-8", "h100x1"])
def test_cost_counts_kernels_by_their_declared_cost(target):
    """A Pallas kernel counts as its declared pl.CostEstimate (TPU: from its backend config; GPU:
    from its op_name, where jax's lowering drops it); the routed experts' grouped kernels (under
    moe.ROUTED_SCOPE) have `unchosen_bytes` taken off once per expert weight they read (the
    fused first half: two) and their flops scaled by `routed_flop_share` of their output's shape
    and the weights they read, a grouped matmul outside the scope (wo_a) not."""
    import jax
    import jax.numpy as jnp

    from dsv4_jax.model.moe import ROUTED_SCOPE
    from pallas_kernels import grouped_matmul, grouped_swiglu

    def f(x, z, w, v, g):  # (as the model's experts: the second half takes the first half's output,
        # whose name its line holds; two row sets, so that no two calls are the same product)
        with jax.named_scope(ROUTED_SCOPE):
            first_half = grouped_swiglu(x, w, v, g, jnp.ones(x.shape[:1]), limit=0.0, impl="pallas")
            routed = grouped_matmul(first_half, w, g, impl="pallas")
        return routed, grouped_matmul(z, v, g, impl="pallas")

    stack, rows = jax.ShapeDtypeStruct((8, 256, 256), jnp.bfloat16), jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    args = (rows, rows, stack, stack, jax.ShapeDtypeStruct((8,), jnp.int32))
    compiled = aot.compile_for(target, jax.jit(f), *args).compiled
    platform = aot.target(target).platform
    calls = [(m, f"/{ROUTED_SCOPE}/" in line) for line in compiled.as_text().splitlines() if "custom-call(" in line
             for m in [plan._DECLARED.search(line) or plan.DECLARED_COST.search(line)] if m]
    declared, flops = [float(m.group(2)) for m, _ in calls], [float(m.group(1)) for m, _ in calls]
    assert len(calls) == 3 and min(declared) >= 8 * 256 * 256 * 2  # every expert's
    full = plan.program_cost(compiled.as_text(), 0, None, platform)
    shapes = []
    less = plan.program_cost(compiled.as_text(), 0, None, platform, unchosen_bytes=1e5,
                             routed_flop_share=lambda m, n, w: shapes.append((m, n, w)) or 0.25)
    assert full["bytes_accessed"] >= sum(declared) and full["flops"] >= sum(flops) > 0
    assert full["bytes_accessed"] - less["bytes_accessed"] == pytest.approx(3e5)
    routed_flops = sum(fl for fl, (_, routed) in zip(flops, calls) if routed)
    assert sorted(shapes) == [(64, 256, 1), (64, 256, 2)] and full["flops"] - less["flops"] == pytest.approx(
        0.75 * routed_flops)


@pytest.mark.parametrize("target", ["v5p-8", "h200x8"])
def test_routed_flop_share_is_what_the_kernel_computes(tmp_path, target):
    """routed_flop_share, the share of a routed grouped matmul's declared flops dsv4-plan counts,
    against the steps the kernel computes (the count of computing steps in its own step metadata,
    `_metadata`) for uniformly drawn routings of every device's tokens, at decode and prefill
    sizes: within 5 % of their mean. Below 1, since the kernel declares every step its buffer
    could need."""
    import jax
    import numpy as np

    from dsv4_jax.model import sharding
    from dsv4_jax.model.moe import exchange_rows
    from pallas_kernels import grouped_matmul_gpu, grouped_matmul_tpu

    s = plan.setup(_config(tmp_path, SMALL, "small"), target, None, None, None, "native")
    cfg, platform = s.cfg, aot.target(target).platform
    devices, k = s.shards(sharding.EXPERTS), cfg.num_experts_per_tok
    local = cfg.n_routed_experts // devices
    assert plan.expert_exchange_of(cfg, s.mesh) == "ragged_all_to_all"
    rng = np.random.default_rng(0)
    for tokens in (1, 64, 512):
        T = plan.local_tokens(s, tokens)
        m, n, width = exchange_rows(T, k, devices), cfg.moe_intermediate_size, cfg.hidden_size
        if platform == "tpu":
            # (an output of w1's width: the fused first half's call, tiled for both weights)
            tm = grouped_matmul_tpu.tiles(m, n, width, local, "fp4", 2, 1, weights=2)[0]
            declared = grouped_matmul_tpu.max_steps(-(-m // tm), m, local)

            def computing(g):  # the kernel's steps for one device's group sizes: those with a group
                return grouped_matmul_tpu._metadata(g, -(-m // tm), tm, declared)[-1][0]
        else:
            tm = grouped_matmul_gpu.tiles(m, local, "fp4").tm
            grid = grouped_matmul_gpu.max_steps(m, local, tm)  # its last step only ever zeroes
            declared = grid - 1

            def computing(g):
                return grouped_matmul_gpu._metadata(g, m, tm, grid)[-1][0]
        draws = []
        for _ in range(200):
            chosen = np.argsort(rng.random((devices * T, cfg.n_routed_experts)), axis=1)[:, :k]
            # each device's receive buffer: its experts' rows, by expert
            draws.append(np.bincount(chosen.ravel(), minlength=cfg.n_routed_experts).reshape(devices, local))
        steps = np.asarray(jax.vmap(computing)(np.concatenate(draws).astype(np.int32)))
        share = plan.routed_flop_share(s, tokens, platform)(m, n, 2)
        assert share < 1 and share == pytest.approx(steps.mean() / declared, rel=0.05), (tokens, tm, steps.mean())


def test_full_size_configs():
    """The presets are the published models (architecture.md §1.1, §1.4)."""
    flash, pro = preset("flash"), preset("pro")
    assert [len(flash.layers_of_ratio(r)) for r in (0, 4, 128)] == [2, 21, 20]
    assert [len(pro.layers_of_ratio(r)) for r in (0, 4, 128)] == [0, 30, 31]
    assert (pro.hidden_size, pro.num_heads, pro.n_routed_experts, pro.index_topk) == (7168, 128, 384, 1024)


@pytest.mark.parametrize("args, message", [
    (["nosuch", "--target", "v5p-8"], "unknown model 'nosuch'"),
    (["flash", "--target", "v7x-8"], "unknown compile target 'v7x-8'"),
    (["flash", "--target", "v5p-8", "--mesh", "expert=8"], "has 8 devices; v5p-8 has 4"),
    (["flash", "--target", "v5p-8", "--mesh", "expert=3,data=x"], "--mesh must be"),
    (["pro", "--target", "v6e-8", "--mesh", "data=2,expert=4", "--batch", "6"], "--batch 6 must be a positive multiple of 8"),
    (["flash", "--target", "v5p-8", "--weight-dtype", "int8"], "unknown --weight-dtype"),
    (["flash", "--target", "v5p-8", "--max-len", "64", "--prefill-chunk", "128"], "exceeds --max-len"),
    (["flash", "--target", "v5p-8", "--batch", "two"], "invalid int value"),
    (["flash", "--target", "v5p-8", "--kv-cache-dtype", "fp4"], "unknown --kv-cache-dtype 'fp4'"),
    (["flash", "--target", "v5p-8", "--seq-len", "0"], "--seq-len must be positive"),
])
def test_bad_input_is_one_line_and_exit_1(args, message, capsys):
    assert plan.main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dsv4-plan: error: ") and message in err, err


def test_indivisible_layout_is_an_error(tmp_path, capsys):
    cfg = _config(tmp_path, dict(SMALL, n_routed_experts=6), "six")
    assert plan.main([cfg, "--target", "v5p-8"]) == 1
    assert "splits experts (6) into 4 pieces" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    """`python -m dsv4_jax.tools.plan`: bad input exits 1 with its one line and no JSON."""
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "dsv4_jax.tools.plan", str(bad), "--target", "v5p-8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    ours = [line for line in r.stderr.splitlines() if line.startswith("dsv4-plan: error: ")]
    assert len(ours) == 1 and "is not valid JSON" in ours[0]


def test_roofline_runs_fp8_flops_at_the_fp8_rate():
    """`_step_figures`: of a step's flops, those of the FP8 tensor-core kernel (`fp8_flops`) take
    the device's FP8 peak, the rest its bf16 peak (H200: 1979 and 989 dense TFLOP/s); a device
    without FP8 (v5p) runs them all at bf16."""
    import types

    for target, fp8_peak in (("h200x8", 1978.9e12), ("v5p-8", None)):
        dev = aot.target(target).spec
        assert dev.peak_fp8_flops == fp8_peak
        cost = {"flops": 3e12, "fp8_flops": 2e12, "bytes_accessed": 1e6, "collective_bytes": 0.0, "xla_flops": 0.0,
                "xla_bytes_accessed": 0.0, "loops": []}
        step = plan._step_figures(types.SimpleNamespace(target=target), plan.Compiled({}, cost),
                                  {"total": 1e6}, 1)
        want = 1e12 / dev.peak_bf16_flops + 2e12 / (fp8_peak or dev.peak_bf16_flops)
        assert step["bound"] == "compute" and step["fp8_flops"] == 2e12
        assert step["roofline_ms"] == pytest.approx(want * 1e3)
