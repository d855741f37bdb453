"""Capacity of the paged cache against today's slot engine, measured in one run with the same cache
memory (issue 28).

    python -m dsv4_jax.tools.capacity_report [--preset tiny|flash-mini | --ckpt DIR] [--dtype bfloat16|float32]
        [--kv-cache-dtype auto|fp8] [--baseline-kv-cache-dtype auto|fp8] --memory 512MiB [--seq-len 1024] [--baseline-max-len 8192]
        [--paged-max-len N] [--max-tokens 16] [--requests N] [--seed 0] [--computed-memory BYTES]

With the same cache memory M (--memory: every per-sequence array of the cache, i.e. window rings,
compressor states and block table, plus the pools) two engines are built on one model:

* baseline, today's slot engine: every slot holds --baseline-max-len tokens of blocks (num_blocks
  = slots x blocks_per_row(max_len)), as many slots as M holds;
* paged: max_len --paged-max-len (default the baseline's), as many slots (max_num_seqs) as M holds
  when a sequence needs only its --seq-len tokens of blocks; the rest of M goes to the pool (at
  least one max_len sequence of blocks, which the engine requires).

Each stores its cache in --kv-cache-dtype; --baseline-kv-cache-dtype gives the slot engine another
(say today's default, the compute dtype, against the paged engine's FP8 records). Each gets --requests (default: one more than the paged engine's slots) random-prompt greedy
requests of --seq-len tokens in all (prompt and --max-tokens), steps until they are done, and
reports the bytes of its allocated cache arrays (per-slot arrays and pools apart; their sum <= M),
slots, num_blocks, the peak of the requests running at once (the engine's `stats()["running"]`
after each step) and of the blocks used, preemptions and finished requests; then the ratio
paged / baseline. For DeepSeek-V4-Flash and Pro in bf16 (which cannot run here) the same sizing
is computed from `cache_spec` for M (or --computed-memory) bytes per device (a mesh splits the
cache by rows, so a sequence's arrays sit whole on one device), with what a sequence holds
broken down (rings, compressor states by layer kind, table, pool blocks) so that what limits the
ratio shows, and `ratio_limit`, the ratio for large M (of the bytes a sequence holds). Prints
ONE JSON object; bad input is one line and exit status 1.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.model.cache import KV_CACHE_DTYPES, row_axis, block_bytes, blocks_per_row, cache_spec, default_block_size
from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError, byte_size


def _part(path) -> str:
    """What a cache leaf is, by its name: a pool, a ring, a compressor state or the table (pos,
    blocks, shared)."""
    if row_axis(path) is None:
        return "pools"
    key = str(getattr(path[-1], "key", path[-1]))
    return "rings" if key.startswith("ring") else "compressor_states" if key.startswith("state") else "table"


def per_sequence(cfg, max_len: int, dtype, kv_cache_dtype: str) -> dict:
    """Bytes of one slot's arrays by part (cache_spec of one row, no blocks), its compressor states
    by layer kind, and the bytes of one pool block."""
    spec = cache_spec(cfg, 1, max_len, dtype, num_blocks=0, kv_cache_dtype=kv_cache_dtype)
    out, states = {"rings": 0, "compressor_states": 0, "table": 0}, {}
    for path, (shape, dt) in jax.tree_util.tree_flatten_with_path(spec, is_leaf=lambda x: isinstance(x, tuple))[0]:
        part, n = _part(path), int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dt).itemsize
        if part != "pools":
            out[part] += n
        if part == "compressor_states":
            kind = str(path[0].key)
            states[kind] = states.get(kind, 0) + n
    out["slot"] = sum(out.values())
    out["compressor_states_by_kind"] = states
    out["block"] = block_bytes(cfg, default_block_size(cfg), dtype, kv_cache_dtype)
    return out


def plan(cfg, memory: int, seq_len: int, baseline_max_len: int, paged_max_len: int, dtype,
         kv_cache_dtypes: dict) -> dict:
    """Slots and blocks of both engines in `memory` bytes (0 slots: it holds none), each with its
    kv_cache_dtypes[name], what a sequence holds in each, the ratio of their slots and its limit
    for large memory (the ratio of the bytes a sequence holds)."""
    bs = default_block_size(cfg)
    out = {}
    for name, max_len, need in (("baseline", baseline_max_len, baseline_max_len), ("paged", paged_max_len, seq_len)):
        seq = per_sequence(cfg, max_len, dtype, kv_cache_dtypes[name])
        nb, least = blocks_per_row(need, bs), blocks_per_row(max_len, bs)
        slots = memory // (seq["slot"] + nb * seq["block"])
        while slots and memory - slots * seq["slot"] < max(slots * nb, least) * seq["block"]:
            slots -= 1  # the pool must hold one max_len sequence
        blocks = nb * slots if name == "baseline" else (memory - slots * seq["slot"]) // seq["block"] * (slots > 0)
        out[name] = {"kv_cache_dtype": kv_cache_dtypes[name], "max_len": max_len, "slots": slots, "num_blocks": blocks, "blocks_per_sequence": nb,
                     "sequence_bytes": {**{k: seq[k] for k in ("rings", "compressor_states",
                                                               "compressor_states_by_kind", "table")},
                                        "pool_blocks": nb * seq["block"], "total": seq["slot"] + nb * seq["block"]},
                     "least_memory": seq["slot"] + max(nb, least) * seq["block"]}
    out["ratio"] = out["paged"]["slots"] / out["baseline"]["slots"] if out["baseline"]["slots"] else None
    out["ratio_limit"] = out["baseline"]["sequence_bytes"]["total"] / out["paged"]["sequence_bytes"]["total"]
    return out


def allocated(engine) -> dict:
    """Bytes of the engine's allocated cache arrays: per-slot ones (by part) and pools."""
    out = {"rings": 0, "compressor_states": 0, "table": 0, "pools": 0}
    for path, a in jax.tree_util.tree_leaves_with_path(engine.state.cache):
        out[_part(path)] += a.nbytes
    out["per_slot_arrays"] = out["rings"] + out["compressor_states"] + out["table"]
    out["total"] = out["per_slot_arrays"] + out["pools"]
    cache = sum(a.nbytes for a in jax.tree.leaves(engine.state.cache))
    out["state_outside_cache"] = sum(a.nbytes for a in jax.tree.leaves(engine.state)) - cache
    return out


def run(engine, requests: int, seq_len: int, max_tokens: int, seed: int) -> dict:
    """Submits `requests` random greedy requests of seq_len tokens, steps until all are done."""
    rng = np.random.default_rng(seed)
    reqs = [engine.submit(rng.integers(0, engine.cfg.vocab_size, seq_len - max_tokens).tolist(), max_tokens)
            for _ in range(requests)]
    peak = peak_blocks = steps = 0
    t0 = time.perf_counter()
    while engine.step() or engine.waiting:
        s = engine.stats()
        peak, peak_blocks, steps = max(peak, s["running"]), max(peak_blocks, s["blocks_used"]), steps + 1
    s = engine.stats()
    return {"peak_running": peak, "peak_blocks_used": peak_blocks, "preemptions": s.get("preemptions", 0),
            "finished": sum(r.finish_reason == "length" for r in reqs), "steps": steps,
            "seconds": round(time.perf_counter() - t0, 1)}


def report(model, sizing: dict, memory: int, seq_len: int, max_tokens: int, requests: int | None,
           seed: int) -> dict:
    """Both engines of `sizing` (plan's) built and run one after the other (prefix caching off:
    the blocks in use are the running requests'), and the ratio of their peaks."""
    from dsv4_jax.runtime.engine import Engine

    requests = sizing["paged"]["slots"] + 1 if requests is None else requests
    out = {}
    for name in ("baseline", "paged"):
        p = sizing[name]
        kv_cache_dtype = p["kv_cache_dtype"]
        per = block_bytes(model.config, default_block_size(model.config), model.dtype, kv_cache_dtype)
        engine = Engine(model, slots=p["slots"], max_len=p["max_len"], kv_cache_memory=p["num_blocks"] * per,
                        kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
        out[name] = {"kv_cache_dtype": kv_cache_dtype, "max_len": engine.max_len, "slots": engine.slots, "num_blocks": engine.num_blocks,
                     "allocated_bytes": allocated(engine), **run(engine, requests, seq_len, max_tokens, seed)}
        assert out[name]["allocated_bytes"]["total"] <= memory, (name, out[name]["allocated_bytes"], memory)
        del engine
    out["requests"] = requests
    out["ratio"] = out["paged"]["peak_running"] / out["baseline"]["peak_running"]
    return out


def computed(memory: int, seq_len: int, baseline_max_len: int, paged_max_len: int, kv_cache_dtypes: dict) -> dict:
    """plan() for the published models in bf16, M bytes per device (computed, not run)."""
    from dsv4_jax.model.presets import preset

    return {name: plan(preset(name), memory, seq_len, baseline_max_len, paged_max_len, jnp.bfloat16, kv_cache_dtypes)
            for name in ("flash", "pro")}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="capacity_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="a converted checkpoint (default: a random --preset model)")
    ap.add_argument("--preset", default="tiny", help="random_checkpoint preset without --ckpt")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    ap.add_argument("--baseline-kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                    help="the slot engine's (default: --kv-cache-dtype)")
    ap.add_argument("--memory", type=byte_size, required=True, help="cache bytes of each engine (512MiB, 2GB, ...)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens of each request (prompt and max tokens)")
    ap.add_argument("--baseline-max-len", type=int, default=8192)
    ap.add_argument("--paged-max-len", type=int, default=None, help="default: --baseline-max-len")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    ap.add_argument("--requests", type=int, default=None, help="default: one more than the paged engine's slots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--computed-memory", type=byte_size, default=None,
                    help="cache bytes per device for the computed Flash and Pro figures (default: --memory)")
    try:
        args = ap.parse_args(argv)
        paged_max_len = args.paged_max_len or args.baseline_max_len
        if not 1 <= args.max_tokens < args.seq_len:
            raise UsageError(f"--max-tokens must be in [1, --seq-len), got {args.max_tokens}")
        if args.seq_len > min(args.baseline_max_len, paged_max_len):
            raise UsageError(f"--seq-len {args.seq_len} exceeds the max_len "
                             f"{min(args.baseline_max_len, paged_max_len)}")
        if args.requests is not None and args.requests < 1:
            raise UsageError("--requests must be >= 1")
        from dsv4_jax.tools.random_checkpoint import report_model

        model = report_model(args.ckpt, args.preset, getattr(jnp, args.dtype), args.seed)
        if max(paged_max_len, args.baseline_max_len) > model.config.max_position_embeddings:
            raise UsageError(f"max_len {max(paged_max_len, args.baseline_max_len)} exceeds the model's "
                             f"max_position_embeddings ({model.config.max_position_embeddings})")
        kv_cache_dtypes = {"baseline": args.baseline_kv_cache_dtype or args.kv_cache_dtype,
                           "paged": args.kv_cache_dtype}
        sizing = plan(model.config, args.memory, args.seq_len, args.baseline_max_len, paged_max_len, model.dtype,
                      kv_cache_dtypes)
        for name in ("baseline", "paged"):
            if not sizing[name]["slots"]:
                raise UsageError(f"--memory {args.memory} bytes holds no {name} sequence: one needs "
                                 f"{sizing[name]['least_memory']} bytes")
    except (UsageError, OSError, ValueError) as e:
        print(f"capacity_report: error: {e}", file=sys.stderr)
        return 1
    out = {"tool": "capacity_report", "model": args.ckpt or args.preset, "dtype": args.dtype,
           "memory": args.memory, "seq_len": args.seq_len,
           "max_tokens": args.max_tokens, "computed_memory": args.computed_memory or args.memory,
           **report(model, sizing, args.memory, args.seq_len, args.max_tokens, args.requests, args.seed),
           "computed": computed(args.computed_memory or args.memory, args.seq_len, args.baseline_max_len,
                                paged_max_len, kv_cache_dtypes)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
