"""Throughput benchmark: our JAX DeepSeek-V4 against transformers' DeepseekV4ForCausalLM.

    python -m dsv4_jax.tools.bench [--quick] [--skip-transformers] [--out FILE] [--compile-cache DIR|off]

Builds the "flash-mini" model (Flash's attention geometry on an 8-layer, 512-wide body; the
config is written in the legacy / official form), randomises every parameter of a transformers
model (dsv4_jax.tools.hf_reference), saves it with `save_pretrained` and loads the same weights
with `dsv4_jax.load`, then times both sides in fp32 in the same process and prints ONE JSON
object (also written to --out): prefill tokens/s, decode tokens/s at batch 1 and 8, decode step
time at several context lengths, our compile times, the ratios ours / transformers and the goals.

With --skip-transformers no torch is needed: our weights come from `dsv4_jax.init_params`.
--quick shrinks the model and every size (for the test suite); its figures mean nothing.
The persistent compilation cache is off by default here, since the benchmark reports compile
times (with a warm cache they would be load times); `--compile-cache DIR` turns it on, and
env.compile_cache records it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.deepseek_v4 import DeepseekV4
from dsv4_jax.model.layer_weights import unstack_layers
from dsv4_jax.runtime import compile_cache
from dsv4_jax.runtime import decode
from dsv4_jax.runtime.buckets import prefill_chunks, prefill_plan
from .hf_reference import make_model
from .random_checkpoint import FLASH_MINI  # the "flash-mini" model's config (legacy HF form)

# --quick: every layer kind, small widths.
QUICK_MODEL = dict(
    FLASH_MINI, vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=2, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32,
    sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=8, compress_ratios=[0, 4, 128],
    n_routed_experts=4,
)

FULL_SIZES = dict(prefill_len=2048, prompt_len=64, new_tokens=64, batches=(1, 8), contexts=(1024, 4096, 16384),
                  hf_contexts=(1024, 4096), hf_new_tokens=(32, 16), repeats=5, hf_repeats=3, step_repeats=20,
                  step_rounds=11)
QUICK_SIZES = dict(prefill_len=256, prompt_len=16, new_tokens=8, batches=(1, 2), contexts=(128, 512),
                   hf_contexts=(128,), hf_new_tokens=(4, 4), repeats=2, hf_repeats=1, step_repeats=3,
                   step_rounds=2)

GOALS = {  # name: (measured key, comparison, threshold)
    "decode_b1_speedup": ("ratios.decode_tokens_per_s_b1", ">=", 2.5),
    "decode_b8_speedup": ("ratios.decode_tokens_per_s_b8", ">=", 8.0),
    "prefill_2048_speedup": ("ratios.prefill_tokens_per_s", ">=", 5.0),
    "decode_step_16k_over_1k": ("ours.decode_step_growth_16k_over_1k", "<=", 1.3),
}


def _median_time(fn, repeats: int, setup=None) -> tuple[float, list[float]]:
    """Median seconds of fn(setup()) over repeats runs (setup untimed); fn must block."""
    times = []
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# transformers side

def bench_transformers(model, sizes: dict, vocab: int) -> dict:
    import torch

    rng = np.random.default_rng(1)
    out: dict = {}

    def ids(b, n):
        return torch.as_tensor(rng.integers(0, vocab, size=(b, n)), dtype=torch.long)

    @torch.no_grad()
    def prefill(x):
        return model(input_ids=x, use_cache=True, logits_to_keep=1)

    def cache_of(o):  # transformers 5.24 names it `cache` (`past_key_values` is deprecated)
        return o.cache if getattr(o, "cache", None) is not None else o.past_key_values

    @torch.no_grad()
    def one(tok, past):
        return model(input_ids=tok, cache=past, use_cache=True)

    @torch.no_grad()
    def decode(past, tok, n):
        for _ in range(n):
            o = one(tok, past)
            past = cache_of(o)
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
        return past

    # prefill
    S = sizes["prefill_len"]
    x = ids(1, S)
    prefill(ids(1, 64))  # warm-up (allocator, kernels)
    t, ts = _median_time(lambda _: prefill(x), sizes["hf_repeats"])
    out["prefill"] = {"tokens": S, "batch": 1, "seconds": t, "tokens_per_s": S / t, "runs_s": ts}

    # decode throughput after a short prompt: a manual greedy loop over model(...) with its cache
    n_new = sizes["new_tokens"]
    for b in sizes["batches"]:
        prompt = ids(b, sizes["prompt_len"])

        def setup(prompt=prompt):
            o = prefill(prompt)
            return cache_of(o), o.logits[:, -1].argmax(-1, keepdim=True)

        decode(*setup(), 2)  # warm-up
        t, ts = _median_time(lambda s: decode(s[0], s[1], n_new), sizes["hf_repeats"], setup)
        out[f"decode_b{b}"] = {"batch": b, "prompt": sizes["prompt_len"], "new_tokens": n_new, "seconds": t,
                               "tokens_per_s": b * n_new / t, "ms_per_step": 1e3 * t / n_new, "runs_s": ts}

    # decode step time at a context: prefill that context, then time single steps
    steps = {}
    for C, n in zip(sizes["hf_contexts"], sizes["hf_new_tokens"]):
        t0 = time.perf_counter()
        o = prefill(ids(1, C))
        t_pre = time.perf_counter() - t0
        past, tok = cache_of(o), o.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            o = one(tok, past)
            times.append(time.perf_counter() - t0)
            past, tok = cache_of(o), o.logits[:, -1].argmax(-1, keepdim=True)
        times = times[1:] if len(times) > 2 else times
        steps[str(C)] = {"ms": 1e3 * statistics.median(times), "steps_timed": len(times),
                         "prefill_s": t_pre, "how": f"prefilled {C} random tokens, then timed single steps"}
    out["decode_step"] = steps
    return out


# ---------------------------------------------------------------------------------------------
# our side

def _prefill_all(model: DeepseekV4, params, ids: np.ndarray, max_len: int):
    """generate()'s prefill of `model` with the weights `params`: their per-layer split (CPU), then
    the prompt in chunks of PREFILL_CHUNK (the last cut to a power of two; decode.prefill, greedy).
    Returns (each row's first token, the state)."""
    cfg, params = model.config, unstack_layers(params)
    B = ids.shape[0]
    state = decode.new_state(model, B, max_len)
    greedy = decode.Sampling.rows(B, cfg.vocab_size)
    for chunk, n, _ in prefill_chunks(ids, np.full(B, ids.shape[1], np.int32)):
        first, state = decode.prefill(params, None, state, None, chunk, n, None, None, greedy, cfg)
    return first.tokens, state


def _compile_seconds(jitted, *args) -> float:
    t0 = time.perf_counter()
    jitted.lower(*args).compile()
    return time.perf_counter() - t0


def bench_ours(params, cfg: ModelConfig, sizes: dict) -> dict:
    rng = np.random.default_rng(1)
    out: dict = {"compile_s": {}}
    i32 = jnp.int32
    # generate()'s per-layer weight split (CPU) happens once per call, before its prefill: the
    # prefill timing below includes it, the decode timings reuse this one
    split = unstack_layers(params)

    # prefill (generate's chunking: chunks of 512, then powers of two)
    S = sizes["prefill_len"]
    max_len = -(-(S + 1) // 128) * 128
    ids = rng.integers(0, cfg.vocab_size, size=(1, S)).astype(np.int32)
    chunks = [T for T, _ in prefill_plan([S])]
    one, model = np.ones(1, np.int32), DeepseekV4(params, cfg)
    out["compile_s"]["prefill"] = {
        str(c): _compile_seconds(decode.prefill, split, None, decode.new_state(model, 1, max_len), None,
                                 jnp.zeros((1, c), i32), one, None, None, decode.Sampling.rows(1, cfg.vocab_size), cfg)
        for c in sorted(set(chunks))}
    run = lambda _: jax.block_until_ready(_prefill_all(model, params, ids, max_len))
    run(None)  # warm-up (first execution)
    t, ts = _median_time(run, sizes["repeats"], lambda: None)
    out["prefill"] = {"tokens": S, "batch": 1, "chunks": chunks, "seconds": t, "tokens_per_s": S / t,
                      "runs_s": ts}

    # decode throughput: generate()'s jitted decode loop after a prompt, n_new steps (as many as
    # transformers runs): n_new + 1 tokens, the first from the prefill
    P, n_new = sizes["prompt_len"], sizes["new_tokens"]
    for b in sizes["batches"]:
        max_len = -(-(P + n_new) // 128) * 128
        prompt = rng.integers(0, cfg.vocab_size, size=(b, P)).astype(np.int32)
        buf = np.zeros((b, max_len), np.int32)
        buf[:, :P] = prompt
        rows = (np.zeros((b,), bool),)  # no padding rows
        extra = (decode.Sampling.rows(b, cfg.vocab_size), np.full((1,), -1, np.int32), cfg)  # greedy, no eos

        def setup():
            return jax.block_until_ready(_prefill_all(model, split, prompt, max_len))

        first, state = setup()
        out["compile_s"][f"decode_loop_b{b}"] = _compile_seconds(
            decode.decode_loop, split, state, first, buf, *rows, i32(n_new + 1), *extra)

        def run_loop(s):
            toks, n_gen, _ = decode.decode_loop(split, s[1], s[0], buf, *rows, i32(n_new + 1), *extra)
            jax.block_until_ready(toks)
            assert int(n_gen.min()) == n_new + 1

        run_loop(setup())  # warm-up
        t, ts = _median_time(run_loop, sizes["repeats"], setup)
        out[f"decode_b{b}"] = {"batch": b, "prompt": P, "new_tokens": n_new, "seconds": t,
                               "tokens_per_s": b * n_new / t, "ms_per_step": 1e3 * t / n_new, "runs_s": ts}

    # decode step time at context C: generate()'s decode loop over step_repeats steps from an
    # empty cache of max_len C + 128 with pos set to C (the work per step depends only on shapes
    # and masks, not on the cache contents). The contexts take turns, one timed run each per
    # round, so that the machine's drift over the minutes of a run (it is shared) moves every
    # context's figure alike instead of the ratio between them.
    n = sizes["step_repeats"]
    tok = rng.integers(0, cfg.vocab_size, size=(1,)).astype(np.int32)
    runners, steps = {}, {}
    for C in sizes["contexts"]:
        max_len = C + 128
        buf = np.zeros((1, max_len), np.int32)
        rows = (np.zeros((1,), bool),)  # no padding rows
        extra = (decode.Sampling.rows(1, cfg.vocab_size), np.full((1,), -1, np.int32), cfg)  # greedy, no eos

        def setup(C=C, max_len=max_len):
            state = decode.new_state(model, 1, max_len)
            state = state._replace(cache=dict(state.cache, pos=jnp.full((1,), C, i32)))
            return jax.block_until_ready((jnp.asarray(tok), state))

        def run_loop(s, buf=buf, rows=rows, extra=extra):
            toks, n_gen, _ = decode.decode_loop(split, s[1], s[0], buf, *rows, i32(n + 1), *extra)
            jax.block_until_ready(toks)
            assert int(n_gen[0]) == n + 1

        first, state = setup()
        steps[str(C)] = {"max_len": max_len,
                         "compile_s": _compile_seconds(decode.decode_loop, split, state, first, buf, *rows, i32(n + 1),
                                                       *extra)}
        del first, state
        run_loop(setup())  # warm-up
        runners[C] = (run_loop, setup)
    times = {C: [] for C in runners}
    for _ in range(sizes["step_rounds"]):
        for C, (run_loop, setup) in runners.items():
            state = setup()
            t0 = time.perf_counter()
            run_loop(state)
            times[C].append(time.perf_counter() - t0)
    for C, ts in times.items():
        steps[str(C)].update(ms=1e3 * statistics.median(ts) / n, min_ms=1e3 * min(ts) / n, steps_timed=n * len(ts))
    out["decode_step"] = steps
    cs = [int(c) for c in steps]
    out["decode_step_growth_16k_over_1k"] = steps[str(max(cs))]["ms"] / steps[str(min(cs))]["ms"]
    return out


# ---------------------------------------------------------------------------------------------
# what the machine allows

def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    return _median_time(lambda _: jax.block_until_ready(fn(*args)), repeats)[0]


def machine_limits(params, cfg: ModelConfig, sizes: dict) -> dict:
    """The memory bandwidth and fp32 matmul rate jax reaches on this machine, measured here,
    and the floors they put under our figures: a decode step must read its weights (the
    non-expert ones and, per layer, every expert some row chose), a prefill must do its
    matmuls. Floors count weights and matmul FLOPs only (no cache reads, no other ops)."""
    f32 = jnp.float32
    # streamed: as many bytes as the model's weights (the set decode steps cycle through, so it
    # sits in the caches exactly as much as they can), at least 32 MiB
    n = max(sum(x.nbytes for x in jax.tree.leaves(params)), 32 << 20) // 4 * 4
    stream = jnp.ones((n // 4,), f32)
    t = _median_seconds(jax.jit(jnp.sum), stream, repeats=5)
    gbps = n / t / 1e9
    del stream
    a, w = jnp.ones((512, cfg.hidden_size), f32), jnp.ones((cfg.hidden_size, 4096), f32)
    t = _median_seconds(jax.jit(jnp.matmul), a, w, repeats=10)
    gflops = 2 * a.shape[0] * a.shape[1] * w.shape[1] / t / 1e9

    L, E, k = cfg.num_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
    expert_bytes = dense_bytes = dense_elems = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if name in ("layers.ffn.w1", "layers.ffn.w2", "layers.ffn.w3"):
            expert_bytes += x.nbytes / (L * E)
        elif name != "embed":  # the embedding is read one row per token
            dense_bytes += x.nbytes
            dense_elems += 0 if name == "head" else int(np.prod(x.shape))
    out = {"stream_GB_per_s": gbps, "matmul_fp32_GFLOP_per_s": gflops,
           "how": f"jnp.sum over {n / 1e6:.0f} MB of fp32 (the weights' size); a [512, {cfg.hidden_size}] x "
                  f"[{cfg.hidden_size}, 4096] fp32 matmul; medians, jitted",
           "weights_MB": {"non_expert": dense_bytes / 1e6, "one_expert_one_layer": expert_bytes / 1e6}}
    for b in sizes["batches"]:
        # experts a step reads per layer: k at batch 1; for b rows each picking k distinct
        # experts uniformly, E * (1 - ((E - k) / E) ** b) in expectation
        experts = E * (1 - ((E - k) / E) ** b)
        out[f"decode_b{b}_step_floor_ms"] = 1e3 * (dense_bytes + L * experts * expert_bytes) / (gbps * 1e9)
        out[f"decode_b{b}_experts_read_per_layer"] = experts
    # prefill matmul FLOPs: every non-expert weight element (but the head: last position only)
    # and k experts per layer once per token, plus attention: window keys, the top-k (ratio 4)
    # or every visible entry (ratio 128), and the indexer's scores over the visible entries
    S = sizes["prefill_len"]
    flops = 2 * S * (dense_elems + L * k * expert_bytes / 4)
    for r in cfg.compress_ratios:
        keys = S * cfg.sliding_window
        if r == 4:
            keys += S * cfg.index_topk
            flops += 2 * cfg.index_n_heads * cfg.index_head_dim * (S * S / 4 / 2)
        elif r == 128:
            keys += S * S / 128 / 2
        flops += 2 * 2 * cfg.num_heads * cfg.head_dim * keys
    out["prefill_GFLOP"] = flops / 1e9
    out["prefill_floor_s"] = flops / (gflops * 1e9)
    return out


def _ceilings(result: dict) -> dict:
    """The best ratio each goal could reach here: transformers' figure over our floor."""
    lim, hf = result["limits"], result["transformers"]
    out = {"prefill_tokens_per_s": hf["prefill"]["seconds"] / lim["prefill_floor_s"]}
    for b in result["sizes"]["batches"]:
        if f"decode_b{b}" in hf:
            out[f"decode_tokens_per_s_b{b}"] = hf[f"decode_b{b}"]["ms_per_step"] / lim[f"decode_b{b}_step_floor_ms"]
    return out


# ---------------------------------------------------------------------------------------------

def _get(d: dict, dotted: str):
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ratios(ours: dict, hf: dict) -> dict:
    r = {"prefill_tokens_per_s": ours["prefill"]["tokens_per_s"] / hf["prefill"]["tokens_per_s"]}
    for k in ours:
        if k.startswith("decode_b") and k in hf:
            r[f"decode_tokens_per_s_{k[len('decode_'):]}"] = ours[k]["tokens_per_s"] / hf[k]["tokens_per_s"]
    r["decode_step_speedup"] = {}
    for c, v in hf["decode_step"].items():
        if isinstance(v, dict) and c in ours["decode_step"]:
            r["decode_step_speedup"][c] = v["ms"] / ours["decode_step"][c]["ms"]
    return r


def _goals(result: dict, quick: bool) -> dict:
    goals = {}
    for name, (key, op, thr) in GOALS.items():
        key = key.replace("_b8", f"_b{result['sizes']['batches'][-1]}") if quick else key
        v = _get(result, key)
        if v is None:
            goals[name] = {"measured": None, "goal": f"{op} {thr}", "pass": None, "note": "not measured"}
        else:
            ok = v >= thr if op == ">=" else v <= thr
            goals[name] = {"measured": round(v, 3), "goal": f"{op} {thr}", "pass": bool(ok), "from": key}
            ceiling = _get(result, key.replace("ratios.", "ceilings.", 1)) if key.startswith("ratios.") else None
            if ceiling is not None:  # what the machine's bandwidth or matmul rate allows at best
                goals[name].update(ceiling_here=round(ceiling, 3), reachable_here=bool(ceiling >= thr))
    return goals


def _torch_threads(model, cores: int, forced: int | None, cfg_vocab: int) -> tuple[int, dict]:
    """torch threads to time transformers with: `forced`, else the machine's cores, unless the
    machine is so loaded that torch's OpenMP threads oversubscribe it (a decode step then takes
    many times longer on all cores than on one), which a short probe of decode steps at `cores`
    and at 1 thread detects (cores more than 1.5x slower: 1 thread)."""
    import torch

    if forced:
        return forced, {"forced": forced}
    if cores == 1:
        return 1, {}
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, cfg_vocab, size=(1, 16)), dtype=torch.long)
    probe = {}
    for n in (cores, 1):
        torch.set_num_threads(n)
        with torch.no_grad():
            o = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            c, tok = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)
            ts = []
            for _ in range(4):
                t0 = time.perf_counter()
                o = model(input_ids=tok, cache=c, use_cache=True)
                ts.append(time.perf_counter() - t0)
        probe[f"decode_step_ms_{n}_threads"] = 1e3 * statistics.median(ts[1:])
    slow = probe[f"decode_step_ms_{cores}_threads"] > 1.5 * probe["decode_step_ms_1_threads"]
    probe["chosen"] = 1 if slow else cores
    probe["why"] = ("oversubscribed: the machine's other load makes torch's threads wait on each other"
                    if slow else "machine's cores")
    return probe["chosen"], probe


def run(quick: bool = False, skip_transformers: bool = False, torch_threads: int | None = None,
        compile_cache_dir: str | None = None) -> dict:
    sizes = dict(QUICK_SIZES if quick else FULL_SIZES)
    d = QUICK_MODEL if quick else FLASH_MINI
    cores = os.cpu_count() or 1
    result: dict = {
        "model": "quick" if quick else "flash-mini",
        "hf_config": d,
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
        "env": {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
                "devices": [str(x) for x in jax.devices()], "cpu_count": cores,
                "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
                "dtype": "float32 (both sides)", "loadavg_1m_start": _load(),
                "compile_cache": compile_cache_dir or "off"},
    }
    hf = None
    t0 = time.perf_counter()
    if not skip_transformers:
        import torch
        import transformers

        from dsv4_jax.checkpoint.loading import load

        hf = make_model(d, seed=0)
        threads, probe = _torch_threads(hf, cores, torch_threads, cfg_vocab=d["vocab_size"])
        torch.set_num_threads(threads)
        result["env"].update(torch=torch.__version__, transformers=transformers.__version__,
                             torch_threads=torch.get_num_threads(), torch_thread_probe=probe)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            model = load(tmp)
        params, cfg = model.params, model.config
        weights = "transformers DeepseekV4ForCausalLM, every parameter randomised, save_pretrained -> dsv4_jax.load"
    else:
        from dsv4_jax.model.params import init_params

        cfg = ModelConfig.from_hf(d)
        params = init_params(cfg, seed=0)
        weights = "dsv4_jax.init_params (random)"
    result["weights"] = weights
    result["params"] = int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))
    result["build_s"] = time.perf_counter() - t0

    result["ours"] = bench_ours(params, cfg, sizes)
    result["limits"] = machine_limits(params, cfg, sizes)
    if hf is not None:
        hf_out = bench_transformers(hf, sizes, cfg.vocab_size)
        for C in sizes["contexts"]:
            if str(C) not in hf_out["decode_step"]:
                hf_out["decode_step"][str(C)] = (
                    f"not run: transformers prefills a context in one forward whose attention builds S x S "
                    f"masks and scores ({C} x {C} x {cfg.num_heads} heads fp32 = "
                    f"{C * C * cfg.num_heads * 4 / 2**30:.1f} GiB of scores) and takes minutes on this 2-core "
                    f"machine; measured up to {max(sizes['hf_contexts'])}")
        result["transformers"] = hf_out
        result["ratios"] = _ratios(result["ours"], hf_out)
        result["ceilings"] = _ceilings(result)
    else:
        result["transformers"] = "skipped (--skip-transformers)"
    result["goals"] = _goals(result, quick)
    result["env"]["loadavg_1m_end"] = _load()
    result["notes"] = [
        "ours: jax.jit on CPU, fp32; throughput excludes compilation (compiled ahead with .lower().compile(), "
        "then one warm-up execution); times are medians of repeats with block_until_ready.",
        "prefill: generate()'s path (decode.prefill over chunks of 512 tokens, the last cut to a power of two, cache "
        "donated), logits of the last "
        "position only; transformers: one forward of the whole prompt with use_cache=True, logits_to_keep=1.",
        "decode throughput: ours = generate()'s jitted decode.decode_loop (greedy, n steps) after a prefilled prompt; "
        "transformers = a greedy loop of model(next_token, cache=...) calls (no generate() overhead).",
        "ours decode_step at context C: generate()'s decode loop (step_repeats steps, greedy) from an empty "
        "cache of max_len C + 128 with cache['pos'] set to C (the work per step depends only on shapes and "
        "masks, not on the cache contents), ms per token, the median of step_rounds runs taken in turns with the "
        "other contexts; transformers: a real prefill of "
        "C tokens, then single steps.",
        "torch threads: env.torch_threads (os.cpu_count() unless env.torch_thread_probe found the machine "
        "oversubscribed or --torch-threads forced it); XLA CPU uses its own thread pool over the same cores. "
        "The machine is shared: env.loadavg_1m_* record its load at start and end.",
        "limits: memory bandwidth and fp32 matmul rate measured here with jax, and the floors they put under "
        "a decode step (its weights read once: limits.decode_b*_experts_read_per_layer experts per layer, the "
        "expectation under uniform routing) and a prefill (its matmul FLOPs counted from the shapes, no "
        "padding); ceilings = transformers' time / our floor, the best ratio this machine allows.",
        "ratios are ours / transformers for throughput and transformers ms / ours ms for step times "
        "(higher is better for ours in both).",
    ]
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model and sizes (for tests)")
    ap.add_argument("--skip-transformers", action="store_true", help="time only ours (no torch needed)")
    ap.add_argument("--out", help="also write the JSON to this file")
    ap.add_argument("--torch-threads", type=int, help="torch threads (default: the cores, or 1 when a probe "
                                                          "finds the machine oversubscribed)")
    compile_cache.add_flag(ap, default=compile_cache.OFF)
    args = ap.parse_args(argv)
    try:
        if args.out:  # a bad path fails now, not after the benchmark
            _check_writable(args.out)
        cache_dir = compile_cache.enable(args.compile_cache)
    except OSError as e:
        print(f"dsv4-bench: error: {e}", file=sys.stderr)
        return 1
    result = run(quick=args.quick, skip_transformers=args.skip_transformers, torch_threads=args.torch_threads,
                 compile_cache_dir=cache_dir)
    text = json.dumps(result, indent=1, default=lambda o: o if not isinstance(o, float) else round(o, 6))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def _check_writable(path: str) -> None:
    """OSError naming the problem unless a file can be written at `path` (checked without
    creating it)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OSError(f"--out {path}: is a directory")
    if not os.path.isdir(parent):
        raise OSError(f"--out {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OSError(f"--out {path}: permission denied")


if __name__ == "__main__":
    sys.exit(main())
