"""The main job on an embedded default: a tiny random-weight DeepSeek-V4 checkpoint is made on
the spot in the published format (official names, FP8 linears and FP4 experts with their
scales, three shards), converted by `dsv4-convert`, loaded, and generated from.

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
from convert.export_hf import write_hf_checkpoint  # noqa: E402

# Every layer kind (window only, ratio 4 with its indexer, ratio 128), hash and learned routing,
# 4 hyper-connection streams, Flash's rope geometry scaled down.
TINY = dsv4_jax.ModelConfig(
    vocab_size=256, hidden_size=128, num_layers=6, num_heads=4, head_dim=128, rope_head_dim=32,
    q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=32,
    compress_ratios=(0, 4, 128, 4, 128, 4), hash_layers=(True,) + (False,) * 5,
    index_n_heads=16, index_head_dim=64, index_topk=16, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0, yarn=dsv4_jax.Yarn(16.0, 65536, 32.0, 1.0), num_nextn_predict_layers=0)


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
        write_hf_checkpoint(dsv4_jax.init_params(TINY, seed=0, std=0.08), TINY, hf_dir, num_shards=3, quantize=True)
        size = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir))
        print(f"1. made a random {TINY.num_layers}-layer checkpoint, layer kinds {list(TINY.compress_ratios)}: "
              f"{size / 1e6:.1f} MB in 3 safetensors shards (FP8 + FP4) at {hf_dir} ({time.perf_counter() - t0:.1f}s)")

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
