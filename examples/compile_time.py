"""Compile time of the jitted full forward against the layer count: one compiled body per layer
kind, not per layer. Prints JSON.

    python examples/compile_time.py [--seq 256]

Both models have Flash's attention geometry (head_dim 512, rope 64, window 128, YaRN, indexer
heads of 128, top-512) on a narrow body; the 43-layer one has Flash's schedule
[0, 0, 4, 128, ..., 4], the 8-layer one [0, 0, 4, 128, 4, 128, 4, 128]. Parameters are abstract
(nothing is allocated); the timing covers tracing, lowering and XLA compilation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax.model.deepseek_v4 import forward  # noqa: E402
from dsv4_jax.model.params import leaf_dtype, map_spec, param_spec  # noqa: E402


def flash_shaped(num_layers: int) -> dsv4_jax.ModelConfig:
    ratios = (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(num_layers - 2))
    return dsv4_jax.ModelConfig(
        vocab_size=1024, hidden_size=256, num_layers=num_layers, num_heads=8, head_dim=512, rope_head_dim=64,
        q_lora_rank=128, o_groups=2, o_lora_rank=128, sliding_window=128, compress_ratios=ratios,
        hash_layers=tuple(i < 3 for i in range(num_layers)), index_n_heads=16, index_head_dim=128,
        index_topk=512, n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=128,
        routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        yarn=dsv4_jax.Yarn(16.0, 65536, 32.0, 1.0))


def compile_seconds(cfg: dsv4_jax.ModelConfig, seq: int) -> float:
    params = map_spec(lambda _, leaf: jax.ShapeDtypeStruct(leaf[0], leaf_dtype(leaf[1], jnp.float32)),
                      param_spec(cfg))
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    jax.clear_caches()  # every measurement compiles from scratch
    fn = jax.jit(forward, static_argnums=2)
    t = time.perf_counter()
    fn.lower(params, ids, cfg).compile()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    compile_seconds(flash_shaped(4), args.seq)  # warm JAX's own start-up out of the figures
    # Interleaved, best of two each: the order of the two models does not favour either.
    runs = {8: [], 43: []}
    for n in (8, 43, 43, 8):
        runs[n].append(compile_seconds(flash_shaped(n), args.seq))
    small, large = min(runs[8]), min(runs[43])
    print(json.dumps({"seq": args.seq, "compile_s_8_layers": round(small, 3),
                      "compile_s_43_layers": round(large, 3), "ratio_43_over_8": round(large / small, 3),
                      "jax": jax.__version__, "backend": jax.default_backend()}))


if __name__ == "__main__":
    main()
