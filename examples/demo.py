"""The main job on an embedded default: a tiny random-weight DeepSeek-V4 checkpoint made on the
spot (official naming, bf16, sharded), loaded by dsv4_jax, then a greedy continuation.

    python examples/demo.py [--out DIR] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from convert.export_hf import write_hf_checkpoint  # noqa: E402

TINY = dsv4_jax.ModelConfig(
    vocab_size=256, hidden_size=64, num_layers=6, num_heads=4, head_dim=64, rope_head_dim=16,
    q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=16,
    compress_ratios=(0, 4, 128, 4, 128, 4), hash_layers=(True,) + (False,) * 5,
    index_n_heads=16, index_head_dim=32, index_topk=8, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0, yarn=dsv4_jax.Yarn(16.0, 65536, 32.0, 1.0), num_nextn_predict_layers=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens to generate")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="dsv4-demo-")

    t0 = time.time()
    write_hf_checkpoint(dsv4_jax.init_params(TINY, seed=0), TINY, out, num_shards=3)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote a random {TINY.num_layers}-layer checkpoint ({size / 1e6:.1f} MB, 3 shards) to {out} "
          f"in {time.time() - t0:.1f}s")

    t0 = time.time()
    model = dsv4_jax.load(out, dtype=jnp.float32)
    print(f"loaded it in {time.time() - t0:.1f}s: layer kinds {list(model.config.compress_ratios)}")

    prompt = list(np.random.default_rng(0).integers(2, TINY.vocab_size, size=24))
    ids = np.zeros((1, len(prompt) + args.tokens), np.int32)
    ids[0, :len(prompt)] = prompt
    t0 = time.time()
    # One full causal forward per token over a fixed-length buffer (one compilation): positions
    # past the current one never influence it. The cached decoder comes with `generate`.
    for t in range(len(prompt), ids.shape[1]):
        ids[0, t] = int(jnp.argmax(model(ids)[0, t - 1]))
    ids = [int(i) for i in ids[0]]
    print(json.dumps({"prompt": [int(i) for i in prompt], "greedy": ids[len(prompt):],
                      "seconds": round(time.time() - t0, 2)}))


if __name__ == "__main__":
    main()
