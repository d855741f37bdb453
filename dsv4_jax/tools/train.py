"""`dsv4-train --out DIR [--corpus PATH ...] [--preset tiny|small] [--steps N] [--resume]`
(also `python -m dsv4_jax.tools.train`): trains a DeepSeek-V4 from scratch with optax on text
files (dsv4_jax/training/; docs/training.md).

The corpus is files or directories (default: the Python standard library's `.py` sources). A
byte-level BPE is trained on it, then the model, with progress (step, losses, tokens/s) on
stderr. DIR becomes a checkpoint that `dsv4_jax.load`, `dsv4-generate` and `dsv4-serve` read
as it is; --resume continues the run saved in DIR (to --steps, when given). The last line on
stdout is the JSON summary: train_loss, eval_loss (held-out), unigram_loss (the held-out text
under the training text's token frequencies), tokens, seconds, ...

Bad input (no corpus files, a corpus too small for a batch, an output directory that is not
empty or cannot be written, a config the trainer cannot train) is one line on stderr and exit
status 1, and a new run leaves nothing behind.
"""

from __future__ import annotations

import json
import sys
import time

from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError


class _Progress:
    """A progress line on stderr: rewritten in place on a terminal, every tenth of the run otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty = stream, stream.isatty()
        self.t0 = time.monotonic()

    def __call__(self, step: int, steps: int, parts: dict, tokens_per_second: float) -> None:
        width = 24
        done = int(width * step / steps)
        line = (f"[{'#' * done}{'.' * (width - done)}] step {step}/{steps}  loss {parts['lm']:.3f}  "
                f"mtp {parts['mtp']:.3f}  indexer kl {parts['indexer']:.3f}  {tokens_per_second:,.0f} tok/s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == steps else ""))
        elif step == steps or step % max(1, steps // 10) == 0 or step == 1:
            self.stream.write(line + "\n")
        self.stream.flush()


def main(argv=None) -> int:
    from dsv4_jax.training.data import DataError
    from dsv4_jax.training.trainer import PRESETS, TrainError, Trainer, TrainSettings

    ap = ArgumentParser(prog="dsv4-train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the run's directory (new: missing or empty)")
    ap.add_argument("--corpus", nargs="+", default=None, help="text files or directories (default: the Python "
                    "standard library's .py sources)")
    ap.add_argument("--preset", default="tiny", help=f"model and run size: {' | '.join(PRESETS)} (default tiny)")
    ap.add_argument("--config", help="an HF config.json to train instead of the preset's model")
    ap.add_argument("--steps", type=int, help="optimizer steps in all (default: the preset's)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--lr", type=float, help="peak learning rate")
    ap.add_argument("--max-corpus-bytes", type=int, help="read at most this much training text")
    ap.add_argument("--indexer-warmup", type=int, help="steps with a dense indexer (default 10%% of steps)")
    ap.add_argument("--save-every", type=int, default=0, help="also save every N steps (default: at the end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, help="data parallel over the first N devices (default: all)")
    ap.add_argument("--balance-rate", type=float, help="the gate biases' step against expert load after every "
                    "step (auxiliary-loss-free balancing; default 0.001, 0: off)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    try:
        args = ap.parse_args(argv)
        if args.resume:
            given = [f for f in ("corpus", "config", "batch_size", "seq_len", "lr", "max_corpus_bytes",
                                 "indexer_warmup", "devices", "balance_rate") if getattr(args, f) is not None]
            if given:
                raise UsageError(f"--resume continues the run as it was saved; it takes --steps only, not "
                                 f"{', '.join('--' + g.replace('_', '-') for g in given)}")
            run = Trainer.resume(args.out, args.steps)
        else:
            config = None
            if args.config is not None:
                try:
                    with open(args.config) as f:
                        config = json.load(f)
                except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise TrainError(f"cannot read --config {args.config}: {e}") from None
            run = Trainer.start(TrainSettings(
                out=args.out, preset=args.preset, corpus=tuple(args.corpus or ()), steps=args.steps,
                batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, max_corpus_bytes=args.max_corpus_bytes,
                indexer_warmup=args.indexer_warmup, save_every=args.save_every, seed=args.seed, devices=args.devices,
                config=config, **({} if args.balance_rate is None else {"balance_rate": args.balance_rate})))
        summary = run.train(_Progress())
    except (UsageError, TrainError, DataError, OSError) as e:
        print(f"dsv4-train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dsv4-train: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
