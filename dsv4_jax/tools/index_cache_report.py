"""What IndexCache costs in quality and buys in speed, on the same prompts with reuse off and on.

    python -m dsv4_jax.tools.index_cache_report --ckpt DIR [--freq F | --pattern P] [--prompts FILE]
        [--prompt-len 2048] [--num-prompts 2] [--new-tokens 32] [--skip-compressor] [--dtype float32]

Prints one JSON object:
* the schedule (ratio-4 layers, computing and reusing ids);
* per reusing layer, against the layer's own top-k (computed on the same hidden states, not
  used), means over every prompt token (`dsv4_jax.model.deepseek_v4.ReuseMeasures`): the overlap
  (the fraction of its own top-k that the reused selection contains), the Jensen-Shannon
  divergence of its attention with its own ids against the reused ones, and the mass its own-id
  attention puts on entries the reused ids lack (`dropped_mass`);
* KL(off || on) of the next-token distributions at every prompt position (teacher-forced on the
  same tokens): mean and max;
* greedy agreement over the generated tokens: the fraction of equal tokens and each prompt's
  first divergence;
* prefill and decode time, off and on, measured in this run (compile excluded, median of 3);
* `indexer_choice`: how many prompt and generated positions see more ratio-4 entries than
  index_topk. At the others every layer selects every visible entry, reuse changes nothing, and
  the figures say nothing: when no prompt position chooses, the per-layer measures and the KL are null (and
  the greedy agreement too when no generated position chooses either), with a warning on stderr.

--prompts FILE: a JSON list of token-id lists of one length; without it, random tokens (seed 0).
Bad prompts (empty, ragged, ids outside the vocabulary) and --new-tokens < 1 are rejected before
anything compiles.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.checkpoint.loading import load
from dsv4_jax.model.cache import init_cache
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.layer_kinds import CSA
from dsv4_jax.model.deepseek_v4 import DeepseekV4, step, with_options
from dsv4_jax.model.index_cache import index_cache_schedule
from dsv4_jax.runtime import compile_cache
from dsv4_jax.runtime.generate import generate
from dsv4_jax.runtime.request import validate_request


def _median_time(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def choosing_positions(start: int, stop: int, index_topk: int) -> int:
    """How many positions in [start, stop) see more than index_topk ratio-4 entries (entry j is
    visible from position t iff j < (t + 1) // 4), i.e. where the indexer chooses."""
    first = CSA * (index_topk + 1) - 1
    return max(0, stop - max(start, first))


def report(model: DeepseekV4, prompts: list[list[int]], new_tokens: int, **on_options) -> dict:
    off_cfg = with_options(model.config, use_index_cache=False)
    on_cfg = with_options(model.config, use_index_cache=True, **on_options)
    sched = index_cache_schedule(on_cfg)
    if not sched.reusing:
        raise ValueError("this schedule reuses on no layer (freq 1, or a pattern of F only): nothing to measure")
    prompts = validate_request(prompts, on_cfg, new_tokens).prompts
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts must have one length for this report, got lengths {sorted(lengths)}")
    ids = jnp.asarray(prompts, jnp.int32)
    B, S = ids.shape
    max_len = -(-(S + new_tokens) // 128) * 128
    run = jax.jit(step, static_argnums=(3, 4, 5))

    def prefill(cfg, measure=False):
        return run(model.params, init_cache(cfg, B, max_len, model.dtype), ids, cfg, False, measure)

    logits_off = prefill(off_cfg).logits
    on = prefill(on_cfg, True)
    logits_on, reuse = on.logits, jax.tree.map(np.asarray, on.reuse)
    lp_off = jax.nn.log_softmax(logits_off, axis=-1)
    lp_on = jax.nn.log_softmax(logits_on, axis=-1)
    kl = np.asarray(jnp.sum(jnp.exp(lp_off) * (lp_off - lp_on), axis=-1))  # [B, S]

    gen_off = generate(model, prompts, new_tokens, use_index_cache=False)
    gen_on = generate(model, prompts, new_tokens, **dict(on_options, use_index_cache=True))
    a, b = gen_off.tokens, gen_on.tokens
    first_diff = [int(np.argmax(x != y)) if (x != y).any() else None for x, y in zip(a, b)]

    # Timing, compile excluded (everything above compiled both variants).
    prefill_off = _median_time(lambda: prefill(off_cfg).logits)
    prefill_on = _median_time(lambda: prefill(on_cfg).logits)
    decode_off = _median_time(lambda: generate(model, prompts, new_tokens, use_index_cache=False).tokens)
    decode_on = _median_time(lambda: generate(model, prompts, new_tokens, **dict(on_options, use_index_cache=True)).tokens)

    k = on_cfg.index_topk
    in_prompt = choosing_positions(0, S, k)
    # generated token i is sampled from the logits of position S - 1 + i
    in_generation = choosing_positions(S - 1, S - 1 + new_tokens, k)
    if not in_prompt:
        print(f"index_cache_report: warning: prompts of {S} tokens never see more than index_topk={k} ratio-4 "
              f"entries (at most {S // CSA}): every layer selects all of them and reuse changes nothing, so the "
              f"overlap and KL are not measured; use prompts of at least {CSA * (k + 1)} tokens", file=sys.stderr)
    return {
        "schedule": sched.to_dict(),
        "prompts": B, "prompt_len": S, "new_tokens": new_tokens,
        "indexer_choice": {"index_topk": k, "ratio4_entries_at_prompt_end": S // CSA,
                           "prompt_positions_choosing": in_prompt, "generated_positions_choosing": in_generation,
                           "meaningful": in_prompt > 0,
                           "note": "positions that see more ratio-4 entries than index_topk; at the others every "
                                   "layer selects all of them, so reuse cannot change anything there"},
        "per_reusing_layer": {str(i): {name: round(float(v[i]), 4) if in_prompt else None
                                       for name, v in reuse._asdict().items()} for i in sched.reusing},
        "per_reusing_layer_note": "overlap: fraction of the layer's own top-k that the reused ids contain; "
                                  "attention_js: Jensen-Shannon divergence (nats) of its attention with its own "
                                  "ids against the reused ones; dropped_mass: its own-id attention's mass on "
                                  "entries the reused ids lack (model.deepseek_v4.ReuseMeasures)",
        "kl_next_token": {"mean": float(kl.mean()) if in_prompt else None,
                          "max": float(kl.max()) if in_prompt else None,
                          "note": "KL(off || on) in nats, teacher-forced at every prompt position"},
        "greedy_agreement": {"fraction_equal": float((a == b).mean()) if in_prompt or in_generation else None,
                             "first_divergence": first_diff},
        "time_s": {"prefill_off": round(prefill_off, 4), "prefill_on": round(prefill_on, 4),
                   "generate_off": round(decode_off, 4), "generate_on": round(decode_on, 4),
                   "prefill_speedup": round(prefill_off / prefill_on, 3),
                   "generate_speedup": round(decode_off / decode_on, 3),
                   "note": f"median of 3 warm runs; generate = prefill + {new_tokens} decode steps"},
        "options": {k: v for k, v in on_options.items() if v is not None},
        "backend": jax.default_backend(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_jax.tools.index_cache_report", description=__doc__.split("\n\n")[0])
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
    compile_cache.add_flag(ap)
    args = ap.parse_args(argv)
    try:
        compile_cache.enable(args.compile_cache)  # before anything compiles
        for flag, value in (("--prompt-len", args.prompt_len), ("--num-prompts", args.num_prompts),
                            ("--new-tokens", args.new_tokens)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        cfg = ModelConfig.from_hf(args.ckpt)
        if args.prompts:
            with open(args.prompts) as f:
                prompts = json.load(f)
        else:
            rng = np.random.default_rng(0)
            prompts = rng.integers(0, cfg.vocab_size, (args.num_prompts, args.prompt_len)).tolist()
        opts = {"index_topk_pattern": args.pattern} if args.pattern else {"index_topk_freq": args.freq}
        opts["index_cache_skip_compressor"] = args.skip_compressor
        validate_request(prompts, cfg, args.new_tokens)  # before the model is read and anything compiles
        model = load(args.ckpt, dtype=getattr(jnp, args.dtype))
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
