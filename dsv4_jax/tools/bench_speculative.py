"""What speculative decoding buys: tokens per main-model step and tokens/s against decoding
without it, in one run.

    python -m dsv4_jax.tools.bench_speculative [--quick] [--k 3] [--batches 1,8] [--prompt-len 256]
        [--new-tokens 64] [--repeats 3] [--out FILE]

flash-mini (Flash's attention geometry, 8 layers; random weights, its MTP block random too),
float32, greedy. For each batch: `generate` without speculation (the baseline), then with k drafts
a round from (a) drafts forced always right (acceptance 100 %), (b) drafts forced right with
probability 0.7 each (a round keeps the drafts up to the first wrong one), (c) the random MTP
block itself (which almost never agrees with random weights: the cost of drafting with nothing
gained). Forced drafts come from the baseline's own output (`ForcedDrafts`), so every run
produces the same tokens (checked). Prints JSON: per run the seconds (median of repeats, compile
excluded: one untimed run first), tokens/s, main-model steps (verification rounds; the baseline's
are its decode steps), tokens per step per row, the acceptance counters, and the ratio of its
tokens/s to the baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.deepseek_v4 import DeepseekV4
from dsv4_jax.model.mtp import init_mtp_params
from dsv4_jax.model.params import init_params
from dsv4_jax.runtime import speculative
from dsv4_jax.runtime.generate import run_request
from dsv4_jax.runtime.request import MAX_SPECULATIVE_TOKENS, validate_request
from .random_checkpoint import FLASH_MINI, TINY

class ForcedDrafts(NamedTuple):
    """A draft source (as speculative.BlockDrafts) drafting from a known continuation: a chosen
    acceptance, for benchmarks and tests. reference int32 `[B, N]`: each row's tokens from its first
    generated one on (what the main model will produce); a draft for generated token g is
    reference[g] where it is to be right, else reference[g] + 1 (mod V). Draft i of a round is
    right when i < count[b] and a uniform draw is below rate[b]."""

    reference: np.ndarray  # int32 [B, N]
    count: np.ndarray  # int32 [B]
    rate: np.ndarray  # fp32 [B]

    def draft(self, params, state, active, drawn, keys, sampling_params, k: int, cfg):
        V = cfg.vocab_size
        i = jnp.arange(k, dtype=jnp.int32)[None, :]
        want = jnp.take_along_axis(self.reference, jnp.clip(drawn[:, None] + i, 0, self.reference.shape[1] - 1),
                                   axis=1)
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.wrap_key_data(key), (k,)))(speculative.fold(keys, 1))
        right = (i < self.count[:, None]) & (u < self.rate[:, None])
        drafts = jnp.where(right, want, (want + 1) % V).astype(jnp.int32)
        return drafts, jax.nn.one_hot(drafts, V, dtype=jnp.float32), state

    def for_rows(self, rows: int) -> "ForcedDrafts":
        """Padded to `rows` rows (the padding rows draft anything)."""
        return ForcedDrafts(*(np.pad(np.asarray(a), [(0, rows - len(a))] + [(0, 0)] * (np.ndim(a) - 1)) for a in self))


QUICK = dict(prompt_len=40, new_tokens=12, repeats=1, batches=(1, 2))
FULL = dict(prompt_len=256, new_tokens=64, repeats=3, batches=(1, 8))


def _time(fn, repeats: int):
    fn()  # compile and first run
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), times, out


def run(quick: bool = False, k: int = 3, batches=None, prompt_len=None, new_tokens=None, repeats=None) -> dict:
    sizes = dict(QUICK if quick else FULL)
    sizes.update({n: v for n, v in dict(batches=batches, prompt_len=prompt_len, new_tokens=new_tokens,
                                        repeats=repeats).items() if v is not None})
    cfg = TINY if quick else ModelConfig.from_hf(FLASH_MINI)
    model = DeepseekV4(init_params(cfg, seed=0, std=0.05), cfg, mtp=init_mtp_params(cfg, seed=1, std=0.05))
    rng = np.random.default_rng(0)
    out: dict = {"model": "tiny" if quick else "flash-mini", "k": k, "sizes": sizes, "dtype": "float32",
                 "env": {"jax": jax.__version__, "backend": jax.default_backend()}, "batches": {}}
    n = sizes["new_tokens"]
    for B in sizes["batches"]:
        prompts = rng.integers(2, cfg.vocab_size, (B, sizes["prompt_len"])).tolist()
        plain = validate_request(prompts, cfg, n, eos_token_id=None)
        t, ts, base = _time(lambda: run_request(model, cfg, plain), sizes["repeats"])
        runs = {"no speculation": {"seconds": t, "runs_s": ts, "tokens_per_s": B * n / t, "main_model_steps": n - 1,
                                   "tokens_per_step_per_row": 1.0}}
        longer = run_request(model, cfg, validate_request(prompts, cfg, n + k + 1, eos_token_id=None)).tokens
        spec = validate_request(prompts, cfg, n, eos_token_id=None, speculative_tokens=k)
        cases = {"forced 100%": ForcedDrafts(longer, np.full(B, k, np.int32), np.ones(B, np.float32)),
                 "forced 70%": ForcedDrafts(longer, np.full(B, k, np.int32), np.full(B, 0.7, np.float32)),
                 "MTP block (random weights)": None}
        for name, drafter in cases.items():
            t, ts, res = _time(lambda drafter=drafter: run_request(model, cfg, spec, drafter), sizes["repeats"])
            assert res.rows() == base.rows(), f"{name}: speculation changed the greedy output"
            s = res.speculation
            runs[name] = {"seconds": t, "runs_s": ts, "tokens_per_s": B * n / t, "main_model_steps": s["rounds"],
                          "tokens_per_step_per_row": (B * n - B) / s[speculative.NUM_DRAFTS], **s,
                          "speedup": runs["no speculation"]["seconds"] / t}
        out["batches"][str(B)] = runs
    out["notes"] = [
        "seconds: generate() after its prefill and decode programs were compiled (one untimed run first), "
        "the median of `repeats`; it includes the prefill of the prompts, the same in every run.",
        "tokens_per_step_per_row: tokens each row gets per main-model step after its first token (which the "
        "prefill gives): 1 without speculation, the acceptance length with it.",
        "forced drafts come from the output without speculation, so every run's tokens are the same (checked).",
        "On this CPU a verification of k + 1 tokens costs more than a one-token step; on TPU / GPU, where a "
        "decode step is bound by reading the weights, it costs about the same.",
    ]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_jax.tools.bench_speculative", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model and small sizes (tests)")
    ap.add_argument("--k", type=int, default=3, help="drafts a round (default 3)")
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,8)")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--out", help="also write the JSON to this file")
    args = ap.parse_args(argv)
    try:
        batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
        if args.out:
            open(args.out, "a").close()  # a bad path fails now, not after the benchmark
        if not 1 <= args.k <= MAX_SPECULATIVE_TOKENS or (batches and min(batches) < 1):
            raise ValueError(f"--k must be in 1..{MAX_SPECULATIVE_TOKENS} and batches >= 1")
        result = run(args.quick, args.k, batches, args.prompt_len, args.new_tokens, args.repeats)
    except (ValueError, OSError) as e:
        print(f"bench_speculative: error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
