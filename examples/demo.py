"""The main job on an embedded default: a tiny random-weight DeepSeek-V4 checkpoint is made on
the spot in the published format (official names, FP8 linears and FP4 experts with their
scales, three shards, a byte-level tokenizer: `dsv4_jax.tools.random_checkpoint`'s "tiny" preset),
converted by `dsv4-convert`, loaded, and generated from.

    python examples/demo.py [--out DIR] [--tokens N] [--dtype native|bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from convert.cli import convert  # noqa: E402
from dsv4_jax.tools.random_checkpoint import PRESETS, TINY, write_random_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="working directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens to generate per prompt")
    ap.add_argument("--dtype", default="native", choices=("native", "bfloat16", "float32"),
                    help="the converter's --dtype")
    args = ap.parse_args()
    work = args.out or tempfile.mkdtemp(prefix="dsv4-demo-")
    hf_dir, out_dir = os.path.join(work, "hf"), os.path.join(work, "converted")
    try:
        t0 = time.perf_counter()
        write_random_checkpoint(hf_dir, "tiny", seed=0, overwrite=True)
        size = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir))
        print(f"1. made a random {TINY.num_layers}-layer checkpoint, layer kinds {list(TINY.compress_ratios)}: "
              f"{size / 1e6:.1f} MB in {PRESETS['tiny'][1]} safetensors shards (FP8 + FP4) and a byte-level "
              f"tokenizer at {hf_dir} ({time.perf_counter() - t0:.1f}s)")

        t0 = time.perf_counter()
        convert(hf_dir, out_dir, dtype=args.dtype, overwrite=True)
        print(f"2. dsv4-convert --dtype {args.dtype} -> {out_dir} ({time.perf_counter() - t0:.1f}s)")

        t0 = time.perf_counter()
        model = dsv4_jax.load(out_dir)
        print(f"3. loaded it ({time.perf_counter() - t0:.1f}s)")

        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(2, TINY.vocab_size, n))) for n in (40, 7, 150)]
        t0 = time.perf_counter()
        out = dsv4_jax.generate(model, prompts, args.tokens)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = dsv4_jax.generate(model, prompts, args.tokens)
        warm = time.perf_counter() - t0
        assert again.rows() == out.rows()
        n = int(out.lengths.sum())
        print(f"4. greedy generate, a ragged batch of prompts of {[len(p) for p in prompts]} tokens: {n} new "
              f"tokens in {first:.1f}s with compilation, {warm:.2f}s warm ({n / warm:.0f} tokens/s)")
        print(json.dumps({"prompt_lengths": [len(p) for p in prompts], "generated": out.rows()}))
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
