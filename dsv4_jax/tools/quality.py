"""What a trained checkpoint (`dsv4-train`'s) does on held-out text: one JSON object.

    python -m dsv4_jax.tools.quality CKPT [--corpus PATH ...] [--sections loss,index-cache,mtp,precision]
        [--windows 32] [--prompts 4] [--prompt-len 256] [--new-tokens 64] [--write-prompts FILE]

The held-out text is the run's: the files of its corpus (config.json "trained", or --corpus)
that the trainer held out, tokenized by the checkpoint's tokenizer; losses are over `--windows`
windows of the run's seq_len + 1 tokens, prompts are held-out spans of --prompt-len tokens.

* loss: held-out cross-entropy and perplexity (fp32) against the unigram baseline (the held-out
  tokens under the training text's token frequencies, add-one smoothed).
* index-cache: the held-out loss with IndexCache off, freq 2, freq 4 and the pattern that reuses
  on the last ratio-4 layer only; per setting, the mean next-token KL(off || on) over the windows
  and, per reusing layer, the overlap of its own top-k with the reused one, the Jensen-Shannon
  divergence of its attention with its own top-k against with the reused one, and the attention
  mass it would have put on entries the reused ids lack (`dsv4_jax.model.deepseek_v4.ReuseMeasures`).
* mtp: greedy speculative decoding with the MTP block, k = 1, 2, 3, on the prompts one at a time:
  acceptance per draft position, acceptance length (tokens per main-model step), tokens/s against
  plain greedy decoding (timed after a warm-up call), and whether the tokens equal plain greedy's.
* precision: bfloat16 weights against float32 (held-out loss; greedy divergence: per prompt the
  first generated token that differs, --new-tokens when none), and the FP8 KV cache against the
  bf16 one (held-out loss; greedy divergence through the engine).

--write-prompts FILE also writes the prompts as a JSON list of token-id lists (for
`python -m dsv4_jax.tools.index_cache_report --prompts FILE`). Bad input is one line on stderr
and exit status 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

SECTIONS = ("loss", "index-cache", "mtp", "precision")


@partial(jax.jit, static_argnums=(2, 3, 4))
def _window_logits(params, windows, cfg, kv_cache_dtype: str, measure_reuse: bool):
    """fp32 logits `[B, S, V]` of windows[:, :-1] from a fresh cache, and the ReuseMeasures (None
    without measure_reuse)."""
    B, S1 = windows.shape
    from dsv4_jax.model.cache import init_cache
    from dsv4_jax.model.deepseek_v4 import step

    cache = init_cache(cfg, B, S1 - 1, params["embed"].dtype, kv_cache_dtype=kv_cache_dtype)
    out = step(params, cache, windows[:, :-1], cfg, measure_reuse=measure_reuse)
    return out.logits, out.reuse


def _log_probs(logits, windows):
    lp = jax.nn.log_softmax(logits, axis=-1)
    return lp, -jnp.mean(jnp.take_along_axis(lp, windows[:, 1:, None], axis=-1))


class Measure:
    """The measurements over one checkpoint's held-out windows and prompts."""

    def __init__(self, ckpt: str, windows: list[np.ndarray], prompts: list[list[int]], new_tokens: int):
        from dsv4_jax.checkpoint.loading import load

        self.ckpt, self.windows, self.prompts, self.new_tokens = ckpt, windows, prompts, new_tokens
        self.model = load(ckpt, mtp=True)

    def loss(self, model=None, kv_cache_dtype: str = "auto", reference=None, **options) -> dict:
        """Held-out loss of `model` (default the fp32 one) with these run-time options; with
        `reference` (a list of per-batch log-probs) also the mean KL(reference || this)."""
        from dsv4_jax.model.deepseek_v4 import with_options

        model = model or self.model
        cfg = with_options(model.config, **options)
        measure = bool(options.get("use_index_cache"))
        losses, kls, reuses, lps = [], [], [], []
        for i, w in enumerate(self.windows):
            w = jnp.asarray(w)
            logits, reuse = _window_logits(model.params, w, cfg, kv_cache_dtype, measure)
            lp, ce = _log_probs(logits, w)
            losses.append(float(ce))
            lps.append(lp)
            if reference is not None:
                kls.append(float(jnp.mean(jnp.sum(jnp.exp(reference[i]) * (reference[i] - lp), axis=-1))))
            if measure:
                reuses.append(reuse)
        out = {"loss": float(np.mean(losses)), "perplexity": float(np.exp(np.mean(losses)))}
        if reference is not None:
            out["kl_next_token_vs_reference"] = float(np.mean(kls))
        if measure:  # each measure's mean over the batches, per reusing layer (NaN on the others)
            means = {name: np.mean(np.stack([np.asarray(r[j]) for r in reuses]), axis=0)
                     for j, name in enumerate(reuses[0]._fields)}
            out["per_reusing_layer"] = {str(i): {name: round(float(v[i]), 4) for name, v in means.items()}
                                        for i in np.flatnonzero(np.isfinite(means["overlap"]))}
        return out, lps

    def index_cache(self, reference_lps) -> dict:
        from dsv4_jax.model.deepseek_v4 import with_options
        from dsv4_jax.model.index_cache import index_cache_schedule

        n4 = len(self.model.config.layers_of_ratio(4))
        settings = {"freq 2": {"index_topk_freq": 2}, "freq 4": {"index_topk_freq": 4},
                    "pattern " + "F" * (n4 - 1) + "S": {"index_topk_pattern": "F" * (n4 - 1) + "S"}}
        out = {}
        for name, opts in settings.items():
            sched = index_cache_schedule(with_options(self.model.config, use_index_cache=True, **opts))
            res, _ = self.loss(reference=reference_lps, use_index_cache=True, **opts)
            out[name] = {"reusing_layers": list(sched.reusing), **res}
        return out

    def mtp(self) -> dict:
        from dsv4_jax.runtime.generate import generate

        if self.model.mtp is None:
            raise ValueError(f"{self.ckpt} has no MTP block")

        def timed(k):
            rows, stats, seconds = [], [], 0.0
            for p in self.prompts:
                generate(self.model, [p], self.new_tokens, speculative_tokens=k)  # compile, warm
                t = time.perf_counter()
                out = generate(self.model, [p], self.new_tokens, speculative_tokens=k)
                seconds += time.perf_counter() - t
                rows.append(out.rows()[0])
                stats.append(out.speculation)
            return rows, stats, sum(len(r) for r in rows) / seconds

        plain, _, plain_tps = timed(0)
        out = {"plain_tokens_per_second": round(plain_tps, 2)}
        for k in (1, 2, 3):
            rows, stats, tps = timed(k)
            drafts = sum(s["spec_decode_num_drafts"] for s in stats)
            per_pos = [sum(s[f"spec_decode_num_accepted_tokens_pos_{i}"] for s in stats) / max(drafts, 1)
                       for i in range(k)]
            accepted = sum(s["spec_decode_num_accepted_tokens"] for s in stats)
            rounds = sum(s["rounds"] for s in stats)
            out[f"k={k}"] = {"acceptance_rate": round(accepted / max(drafts * k, 1), 4),
                             "acceptance_per_position": [round(x, 4) for x in per_pos],
                             "acceptance_length": round(1 + accepted / max(drafts, 1), 4),
                             "tokens_per_main_step": round(sum(len(r) for r in rows) / max(rounds, 1), 4),
                             "tokens_per_second": round(tps, 2), "speedup": round(tps / plain_tps, 3),
                             "greedy_equal": rows == plain}
        return out

    def precision(self, fp32: dict) -> dict:
        from dsv4_jax.checkpoint.loading import load
        from dsv4_jax.runtime.engine import Engine
        from dsv4_jax.runtime.generate import generate

        bf16 = load(self.ckpt, dtype=jnp.bfloat16)
        out = {"float32_loss": fp32["loss"]}
        out["bfloat16_loss"] = self.loss(bf16)[0]["loss"]
        a = [generate(self.model, [p], self.new_tokens).rows()[0] for p in self.prompts]
        b = [generate(bf16, [p], self.new_tokens).rows()[0] for p in self.prompts]
        out["bfloat16_greedy_divergence"] = [_first_difference(x, y, self.new_tokens) for x, y in zip(a, b)]
        out["fp8_kv_loss"] = self.loss(bf16, kv_cache_dtype="fp8")[0]["loss"]
        max_len = -(-(max(map(len, self.prompts)) + self.new_tokens) // 128) * 128
        runs = {}
        for kv in ("auto", "fp8"):
            eng = Engine(bf16, slots=len(self.prompts), max_len=max_len, kv_cache_dtype=kv)
            reqs = [eng.submit(p, self.new_tokens) for p in self.prompts]
            eng.run_until_idle()
            runs[kv] = [r.tokens for r in reqs]
        out["fp8_kv_greedy_divergence_vs_bf16_kv"] = [_first_difference(x, y, self.new_tokens)
                                                      for x, y in zip(runs["auto"], runs["fp8"])]
        out["note"] = ("losses over the held-out windows; divergence: the first generated token (0-based) that "
                       "differs, new_tokens when none; the FP8 KV figures are on the bf16 model, against its bf16 KV")
        return out


def _first_difference(a: list[int], b: list[int], n: int) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return n if len(a) == len(b) else min(len(a), len(b))


def held_out(ckpt: str, corpus: list[str] | None, windows: int, prompts: int, prompt_len: int):
    """The run's held-out windows (batches of 4) and prompts, the unigram baseline and the facts."""
    from tokenizers import Tokenizer

    from dsv4_jax.training import data

    with open(os.path.join(ckpt, "config.json")) as f:
        trained = json.load(f).get("trained") or {}
    corpus = corpus or trained.get("corpus") or data.default_corpus()
    seq_len = int(trained.get("seq_len", 512))
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    c = data.build_corpus(data.read_corpus(list(corpus), trained.get("max_corpus_bytes")), tok, seq_len, 4)
    batches = c.eval_batches(4, seq_len, windows)
    if len(c.held_out) < prompts * prompt_len * 2:
        raise ValueError(f"the held-out text ({len(c.held_out)} tokens) is too short for {prompts} prompts of "
                         f"{prompt_len}")
    stride = len(c.held_out) // prompts
    spans = [c.held_out[i * stride:i * stride + prompt_len].tolist() for i in range(prompts)]
    facts = {"held_out_tokens": int(len(c.held_out)), "held_out_files": c.held_out_files, "seq_len": seq_len,
             "windows": 4 * len(batches), "prompts": prompts, "prompt_len": prompt_len}
    return batches, spans, c.unigram_loss(tok.get_vocab_size()), facts


def main(argv=None) -> int:
    from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError

    ap = ArgumentParser(prog="python -m dsv4_jax.tools.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="a dsv4-train output directory")
    ap.add_argument("--corpus", nargs="+", help="the corpus (default: the run's, from its config.json)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    ap.add_argument("--windows", type=int, default=32, help="held-out windows for the losses (default 32)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--write-prompts", help="also write the prompts to this JSON file")
    try:
        args = ap.parse_args(argv)
        sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        bad = [s for s in sections if s not in SECTIONS]
        if bad or not sections:
            raise UsageError(f"--sections takes {', '.join(SECTIONS)}; got {args.sections!r}")
        for flag in ("windows", "prompts", "prompt_len", "new_tokens"):
            if getattr(args, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
        if not os.path.isfile(os.path.join(args.ckpt, "config.json")):
            raise ValueError(f"{args.ckpt}: not a checkpoint directory (no config.json)")
        windows, prompts, unigram, facts = held_out(args.ckpt, args.corpus, args.windows, args.prompts,
                                                    args.prompt_len)
        if args.write_prompts:
            with open(args.write_prompts, "w") as f:
                json.dump(prompts, f)
        m = Measure(args.ckpt, windows, prompts, args.new_tokens)
        fp32, reference = m.loss()
        report = {"checkpoint": os.path.abspath(args.ckpt), **facts, "backend": jax.default_backend()}
        if "loss" in sections:
            report["loss"] = {**fp32, "unigram_loss": unigram, "unigram_perplexity": float(np.exp(unigram)),
                              "nats_below_unigram": unigram - fp32["loss"],
                              "perplexity_ratio": float(np.exp(fp32["loss"] - unigram))}
        if "index-cache" in sections:
            report["index_cache"] = {"off": fp32, **m.index_cache(reference)}
        if "mtp" in sections:
            report["mtp"] = m.mtp()
        if "precision" in sections:
            report["precision"] = m.precision(fp32)
    except (UsageError, ValueError, TypeError, OSError) as e:
        print(f"quality: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
