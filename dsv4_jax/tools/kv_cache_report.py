"""What the FP8 KV cache changes in the logits: the same tokens through a model with its cache's
compressed entries and window rings in the compute dtype and as FP8 records (kv_cache_dtype
"fp8", dsv4_jax/model/cache.py), one invocation.

    python -m dsv4_jax.tools.kv_cache_report [--ckpt DIR | --preset tiny|flash-mini] [--dtype bfloat16|float32]
        [--prompt-len 1024] [--decode-steps 32] [--seed 0]

A random prompt of --prompt-len tokens is prefilled in chunks of 256, then --decode-steps tokens
are fed one at a time (the same ids for both caches: the greedy tokens of the compute-dtype run),
and the logits of every position compared. Prints ONE JSON object: the settings, and for the
prefill and the decode positions the largest and mean absolute logit difference, the largest
logit's magnitude, and the share of positions whose top-1 token agrees.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError

CHUNK = 256


def _prefill(model, prompt: np.ndarray, steps: int, kv_cache_dtype: str):
    """The prompt's logits fp32 `[P, V]` (in chunks of CHUNK), the cache (room for `steps` more
    tokens) and the jitted step."""
    from dsv4_jax.model.deepseek_v4 import step

    cfg = model.config
    run = jax.jit(lambda p, c, x: step(p, c, x, cfg), donate_argnums=(1,))
    cache = model.new_cache(1, len(prompt) + steps + 1, kv_cache_dtype=kv_cache_dtype)
    seen = []
    for i in range(0, len(prompt), CHUNK):
        out = run(model.params, cache, jnp.asarray(prompt[None, i:i + CHUNK]))
        seen.append(np.asarray(out.logits[0]))
        cache = out.cache
    return np.concatenate(seen), cache, run


def report(model, prompt_len: int, decode_steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.config.vocab_size, prompt_len).astype(np.int32)
    out, runs = {}, {}
    for kv in ("auto", "fp8"):
        runs[kv] = list(_prefill(model, prompt, decode_steps, kv))
    tokens = [int(np.argmax(runs["auto"][0][-1]))]
    decoded = {"auto": [], "fp8": []}
    for _ in range(decode_steps):
        for kv in ("auto", "fp8"):
            _, cache, run = runs[kv]
            o = run(model.params, cache, jnp.asarray([[tokens[-1]]], jnp.int32))
            runs[kv][1] = o.cache
            decoded[kv].append(np.asarray(o.logits[0, 0]))
        tokens.append(int(np.argmax(decoded["auto"][-1])))
    for part, a, b in (("prefill", runs["auto"][0], runs["fp8"][0]),
                       ("decode", np.stack(decoded["auto"]), np.stack(decoded["fp8"]))):
        d = np.abs(a - b)
        out[part] = {"positions": len(a), "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                     "max_abs_logit": float(np.abs(a).max()),
                     "top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1)))}
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="kv_cache_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="a converted checkpoint (default: a random --preset model)")
    ap.add_argument("--preset", default="flash-mini", help="random_checkpoint preset without --ckpt")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    try:
        args = ap.parse_args(argv)
        if args.prompt_len < 1 or args.decode_steps < 0:
            raise UsageError("--prompt-len must be >= 1 and --decode-steps >= 0")
        from dsv4_jax.tools.random_checkpoint import report_model

        model = report_model(args.ckpt, args.preset, getattr(jnp, args.dtype), args.seed)
    except UsageError as e:
        print(f"kv_cache_report: error: {e}", file=sys.stderr)
        return 1
    out = {"tool": "kv_cache_report", "model": args.ckpt or args.preset, "dtype": args.dtype,
           "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "seed": args.seed,
           **report(model, args.prompt_len, args.decode_steps, args.seed)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
