"""`dsv4-generate --ckpt DIR (--prompt TEXT | --ids 1,2,3) [options]`

Loads a checkpoint (converted by dsv4-convert, or HF safetensors), generates, and prints the
continuation and the speed. Text prompts need the checkpoint's `tokenizer.json` (read with the
`tokenizers` package); `--ids` takes token ids. Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_ids(text: str) -> list[list[int]]:
    """'1,2,3' -> [[1, 2, 3]]; rows separated by ';' make a batch: '1,2;3,4,5'."""
    rows = []
    for row in text.split(";"):
        try:
            rows.append([int(t) for t in row.split(",") if t.strip()])
        except ValueError:
            raise ValueError(f"--ids must be comma-separated integers (rows separated by ';'), got {text!r}") from None
    return rows


def _tokenizer(ckpt: str):
    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"{path} needs the `tokenizers` package (pip install tokenizers)") from None
    return Tokenizer.from_file(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in --ckpt)")
    src.add_argument("--ids", help="prompt token ids, e.g. 1,2,3 (';' separates rows of a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=None, help="cache size in tokens (default: just enough)")
    ap.add_argument("--eos", type=int, default=None, help="stop token id (default: the config's eos_token_id)")
    ap.add_argument("--no-eos", action="store_true", help="do not stop at an eos token")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--attention-impl", choices=("auto", "pallas", "ref"), default="auto")
    ap.add_argument("--index-cache-freq", type=int, default=None,
                    help="IndexCache: ratio-4 layers of rank r reuse the last top-k when r %% F != 0")
    ap.add_argument("--index-cache-pattern", default=None, help="IndexCache: one F/S per ratio-4 layer")
    ap.add_argument("--index-cache-skip-compressor", action="store_true",
                    help="IndexCache: reusing layers also skip their indexer's compressor")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    try:
        import jax.numpy as jnp

        import dsv4_jax

        if not os.path.isdir(args.ckpt):
            raise ValueError(f"checkpoint directory not found: {args.ckpt}")
        tok = _tokenizer(args.ckpt)
        if args.prompt is not None:
            if tok is None:
                raise ValueError(f"--prompt needs {os.path.join(args.ckpt, 'tokenizer.json')}; use --ids instead")
            prompts = [tok.encode(args.prompt).ids]
        else:
            prompts = _parse_ids(args.ids)
        options = {"attention_impl": args.attention_impl}
        if args.index_cache_freq is not None or args.index_cache_pattern is not None:
            options.update(use_index_cache=True, index_topk_freq=args.index_cache_freq,
                           index_topk_pattern=args.index_cache_pattern,
                           index_cache_skip_compressor=args.index_cache_skip_compressor)
        t0 = time.perf_counter()
        model = dsv4_jax.load(args.ckpt, dtype=getattr(jnp, args.dtype), **options)
        load_s = time.perf_counter() - t0
        if model.config.use_index_cache:
            from dsv4_jax.index_cache import index_cache_schedule
            print(index_cache_schedule(model.config).describe(), file=sys.stderr)
        eos = None if args.no_eos else (args.eos if args.eos is not None else model.config.eos_token_id)
        kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
                  seed=args.seed, max_len=args.max_len)
        t0 = time.perf_counter()
        out = dsv4_jax.generate(model, prompts, args.max_new_tokens, **kw)
        gen_s = time.perf_counter() - t0
    except (ValueError, OSError, TypeError) as e:
        print(f"dsv4-generate: error: {e}", file=sys.stderr)
        return 1
    n = int(out.lengths.sum())
    rows = out.rows()
    report = {"load_s": round(load_s, 3), "generate_s": round(gen_s, 3), "new_tokens": n,
              "tokens_per_s": round(n / gen_s, 2), "note": "generate_s includes compilation on first use",
              "rows": [{"prompt_ids": p, "ids": r, "text": tok.decode(r) if tok else None} for p, r in zip(prompts, rows)]}
    if args.json:
        print(json.dumps(report))
    else:
        for row in report["rows"]:
            print(row["text"] if row["text"] is not None else " ".join(map(str, row["ids"])))
        print(f"[{n} tokens in {gen_s:.2f}s: {n / gen_s:.1f} tokens/s including compilation; load {load_s:.2f}s]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
