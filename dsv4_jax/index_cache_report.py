"""What IndexCache costs in quality and buys in speed, on the same prompts with reuse off and on.

    python -m dsv4_jax.index_cache_report --ckpt DIR [--freq F | --pattern P] [--prompts FILE]
        [--prompt-len 2048] [--num-prompts 2] [--new-tokens 32] [--skip-compressor] [--dtype float32]

Prints one JSON object:
* the schedule (ratio-4 layers, computing and reusing ids);
* per reusing layer, the overlap: the mean fraction of the layer's own top-k (computed on the
  same hidden states, not used) that the reused selection contains, over every prompt token;
* KL(off || on) of the next-token distributions at every prompt position (teacher-forced on the
  same tokens): mean and max;
* greedy agreement over the generated tokens: the fraction of equal tokens and each prompt's
  first divergence;
* prefill and decode time, off and on, measured in this run (compile excluded, median of 3).

--prompts FILE: a JSON list of token-id lists; without it, random tokens (seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from .cache import init_cache
from .generate import generate
from .index_cache import index_cache_schedule
from .loading import load
from .model import Model, step, with_options


def _median_time(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def report(model: Model, prompts: list[list[int]], new_tokens: int, **on_options) -> dict:
    off_cfg = with_options(model.config, use_index_cache=False)
    on_cfg = with_options(model.config, use_index_cache=True, **on_options)
    sched = index_cache_schedule(on_cfg)
    if not sched.reusing:
        raise ValueError("this schedule reuses on no layer (freq 1, or a pattern of F only): nothing to measure")
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts must have one length for this report, got lengths {sorted(lengths)}")
    ids = jnp.asarray(prompts, jnp.int32)
    B, S = ids.shape
    max_len = -(-(S + new_tokens) // 128) * 128
    run = jax.jit(step, static_argnums=(3, 4, 5))

    def prefill(cfg, measure=False):
        return run(model.params, init_cache(cfg, B, max_len, model.dtype), ids, cfg, False, measure)

    logits_off, _ = prefill(off_cfg)
    logits_on, _, overlap = prefill(on_cfg, True)
    lp_off = jax.nn.log_softmax(logits_off, axis=-1)
    lp_on = jax.nn.log_softmax(logits_on, axis=-1)
    kl = np.asarray(jnp.sum(jnp.exp(lp_off) * (lp_off - lp_on), axis=-1))  # [B, S]
    overlap = np.asarray(overlap)

    gen_off = generate(model, prompts, new_tokens, use_index_cache=False)
    gen_on = generate(model, prompts, new_tokens, **dict(on_options, use_index_cache=True))
    a, b = gen_off.tokens, gen_on.tokens
    first_diff = [int(np.argmax(x != y)) if (x != y).any() else None for x, y in zip(a, b)]

    # Timing, compile excluded (everything above compiled both variants).
    prefill_off = _median_time(lambda: prefill(off_cfg)[0])
    prefill_on = _median_time(lambda: prefill(on_cfg)[0])
    decode_off = _median_time(lambda: generate(model, prompts, new_tokens, use_index_cache=False).tokens)
    decode_on = _median_time(lambda: generate(model, prompts, new_tokens, **dict(on_options, use_index_cache=True)).tokens)

    return {
        "schedule": sched.to_dict(),
        "prompts": B, "prompt_len": S, "new_tokens": new_tokens,
        "overlap_per_reusing_layer": {str(i): round(float(overlap[i]), 4) for i in sched.reusing},
        "kl_next_token": {"mean": float(kl.mean()), "max": float(kl.max()),
                          "note": "KL(off || on) in nats, teacher-forced at every prompt position"},
        "greedy_agreement": {"fraction_equal": float((a == b).mean()), "first_divergence": first_diff},
        "time_s": {"prefill_off": round(prefill_off, 4), "prefill_on": round(prefill_on, 4),
                   "generate_off": round(decode_off, 4), "generate_on": round(decode_on, 4),
                   "prefill_speedup": round(prefill_off / prefill_on, 3),
                   "generate_speedup": round(decode_off / decode_on, 3),
                   "note": f"median of 3 warm runs; generate = prefill + {new_tokens} decode steps"},
        "options": {k: v for k, v in on_options.items() if v is not None},
        "backend": jax.default_backend(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_jax.index_cache_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--freq", type=int, default=2, help="index_topk_freq (default 2)")
    how.add_argument("--pattern", help="index_topk_pattern, one F/S per ratio-4 layer")
    ap.add_argument("--skip-compressor", action="store_true", help="index_cache_skip_compressor")
    ap.add_argument("--prompts", help="JSON file: a list of token-id lists of one length")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    try:
        model = load(args.ckpt, dtype=getattr(jnp, args.dtype))
        if args.prompts:
            with open(args.prompts) as f:
                prompts = json.load(f)
        else:
            rng = np.random.default_rng(0)
            prompts = rng.integers(0, model.config.vocab_size, (args.num_prompts, args.prompt_len)).tolist()
        opts = {"index_topk_pattern": args.pattern} if args.pattern else {"index_topk_freq": args.freq}
        opts["index_cache_skip_compressor"] = args.skip_compressor
        print(index_cache_schedule(with_options(model.config, use_index_cache=True, **opts)).describe(),
              file=sys.stderr)
        out = report(model, prompts, args.new_tokens, **opts)
    except (ValueError, OSError, TypeError) as e:
        print(f"index_cache_report: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
