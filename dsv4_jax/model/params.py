"""The parameter tree: its layout, shapes, dtypes, and a random initialiser.

Layout (nested dicts of arrays; `L` = main layers, per-kind stacks only hold their own layers):

    embed [V, D]; head [V, D]; norm [D]; hc_head {fn [hc, hc*D], base [hc], scale [1]}
    layers (stacked over all L layers):
        attn_norm [L, D], ffn_norm [L, D]
        hc_attn / hc_ffn {fn [L, (2+hc)*hc, hc*D], base [L, (2+hc)*hc], scale [L, 3]}
        attn {wq_a [L, Q, D], q_norm [L, Q], wq_b [L, H*Dh, Q], wkv [L, Dh, D], kv_norm [L, Dh],
              wo_a [L, G*O, H*Dh/G], wo_b [L, D, G*O], sink [L, H]}
        ffn {gate [L, E, D], w1 [L, E, I, D], w2 [L, E, D, I], w3 [L, E, I, D],
             shared_w1 [L, I, D], shared_w2 [L, D, I], shared_w3 [L, I, D]}
    gate_bias [L_learned, E]                         (layers routed by learned top-k)
    tid2eid [L_hash, V, k] int32                     (hash-routed layers)
    csa (ratio-4 layers) {compressor {wkv [n, 2Dh, D], wgate [n, 2Dh, D], ape [n, 4, 2Dh], norm [n, Dh]},
                          indexer {wq_b [n, HI*dI, Q], weights_proj [n, HI, D],
                                   compressor {wkv [n, 2dI, D], wgate, ape [n, 4, 2dI], norm [n, dI]}}}
    hca (ratio-128 layers) {compressor {wkv [n, Dh, D], wgate [n, Dh, D], ape [n, 128, Dh], norm [n, Dh]}}

A kind's subtree is absent when no layer has that kind. Linear weights are `[out, in]`, as in the
checkpoint. Every leaf's dtype class is one of "weight" (the model dtype), "f32" (kept in fp32
in every mode, as the reference keeps it) or "int". The head, the router's `gate` and the
compressors' `wkv` / `wgate` are "weight" leaves that the model multiplies in fp32, as the
reference does its fp32 copies of them: the published checkpoints store them in bf16, which
holds their values exactly at half the bytes a decode step reads.

Native (quantized) mode: the leaves in `NATIVE_QUANT` may instead hold a
`dsv4_jax.model.quantized.QuantizedWeight` (same logical shape; FP8 for the attention / indexer /
shared-expert linears, FP4 for the routed experts, as the published checkpoints store them). A
leaf is quantized only where the source checkpoint stores it quantized (`dsv4-convert --dtype
native` records which in its config.json); `attn.wo_a` always stays a float array (DeepSeek's
own convert.py dequantizes it too).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .layer_kinds import COMPRESSED, LayerKind

WEIGHT, F32, INT = "weight", "f32", "int"

# Leaves the model reaches only through `linear.dense` / `moe.routed_experts` (so they may be
# QuantizedWeights), with the format the published checkpoints store them in.
NATIVE_QUANT: dict[tuple[str, ...], str] = {
    ("layers", "attn", "wq_a"): "fp8", ("layers", "attn", "wq_b"): "fp8", ("layers", "attn", "wkv"): "fp8",
    ("layers", "attn", "wo_b"): "fp8", ("csa", "indexer", "wq_b"): "fp8",
    ("layers", "ffn", "shared_w1"): "fp8", ("layers", "ffn", "shared_w2"): "fp8",
    ("layers", "ffn", "shared_w3"): "fp8",
    ("layers", "ffn", "w1"): "fp4", ("layers", "ffn", "w2"): "fp4", ("layers", "ffn", "w3"): "fp4",
}


def _compressor_spec(n: int, kind: LayerKind, d: int, hidden: int) -> dict:
    c = kind.compressor_width(d)
    return {"wkv": ((n, c, hidden), WEIGHT), "wgate": ((n, c, hidden), WEIGHT), "ape": ((n, kind.ratio, c), F32),
            "norm": ((n, d), F32)}


def param_spec(cfg: ModelConfig) -> dict:
    """Nested dict with the same structure as the parameters, leaves `(shape, dtype class)`."""
    V, D, L, H, Dh = cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim
    Q, G, O, E, I, hc = (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.n_routed_experts,
                         cfg.moe_intermediate_size, cfg.hc_mult)
    M = (2 + hc) * hc
    hc_site = {"fn": ((L, M, hc * D), F32), "base": ((L, M), F32), "scale": ((L, 3), F32)}
    spec: dict[str, Any] = {
        "embed": ((V, D), WEIGHT),
        "head": ((V, D), WEIGHT),
        "norm": ((D,), F32),
        "hc_head": {"fn": ((hc, hc * D), F32), "base": ((hc,), F32), "scale": ((1,), F32)},
        "layers": {
            "attn_norm": ((L, D), F32),
            "ffn_norm": ((L, D), F32),
            "hc_attn": dict(hc_site),
            "hc_ffn": dict(hc_site),
            "attn": {
                "wq_a": ((L, Q, D), WEIGHT), "q_norm": ((L, Q), F32), "wq_b": ((L, H * Dh, Q), WEIGHT),
                "wkv": ((L, Dh, D), WEIGHT), "kv_norm": ((L, Dh), F32),
                "wo_a": ((L, G * O, H * Dh // G), WEIGHT), "wo_b": ((L, D, G * O), WEIGHT),
                "sink": ((L, H), F32),
            },
            "ffn": {
                "gate": ((L, E, D), WEIGHT),
                "w1": ((L, E, I, D), WEIGHT), "w2": ((L, E, D, I), WEIGHT), "w3": ((L, E, I, D), WEIGHT),
                "shared_w1": ((L, I, D), WEIGHT), "shared_w2": ((L, D, I), WEIGHT),
                "shared_w3": ((L, I, D), WEIGHT),
            },
        },
    }
    n_hash = cfg.num_hash_layers
    if L - n_hash:
        spec["gate_bias"] = ((L - n_hash, E), F32)
    if n_hash:
        spec["tid2eid"] = ((n_hash, V, cfg.num_experts_per_tok), INT)
    HI, dI = cfg.index_n_heads, cfg.index_head_dim
    for kind in COMPRESSED:  # each kind's layers stacked on their own
        n = len(cfg.layers_of_ratio(kind.ratio))
        if n:
            spec[kind.name] = {"compressor": _compressor_spec(n, kind, Dh, D)}
            if kind.indexer:
                spec[kind.name]["indexer"] = {"wq_b": ((n, HI * dI, Q), WEIGHT), "weights_proj": ((n, HI, D), WEIGHT),
                                              "compressor": _compressor_spec(n, kind, dI, D)}
    return spec


def leaf_dtype(kind: str, dtype) -> jnp.dtype:
    return {WEIGHT: jnp.dtype(dtype), F32: jnp.dtype(jnp.float32), INT: jnp.dtype(jnp.int32)}[kind]


def is_spec_leaf(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.05) -> dict:
    """Random parameters with every leaf non-trivial (sinks, ape, biases, hc base/scale included;
    tid2eid draws k distinct experts per token), for tests and demos."""
    rng = np.random.default_rng(seed)
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts

    def make(path, leaf):
        shape, kind = leaf
        name = path[-1]
        if kind == INT:  # tid2eid: k distinct experts per token
            out = np.argsort(rng.random(shape[:-1] + (E,)), axis=-1)[..., :k]
            return jnp.asarray(out, jnp.int32)
        if name in ("norm", "attn_norm", "ffn_norm", "q_norm", "kv_norm"):
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "scale":
            arr = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name in ("sink", "base", "ape", "gate_bias"):
            arr = 0.5 * rng.standard_normal(shape)
        else:
            arr = std * rng.standard_normal(shape)
        return jnp.asarray(arr, leaf_dtype(kind, dtype))

    return map_spec(make, param_spec(cfg))


def map_spec(fn, spec, path=()):
    """Maps fn(path, (shape, kind)) over a spec tree."""
    if is_spec_leaf(spec):
        return fn(path, spec)
    return {k: map_spec(fn, v, path + (k,)) for k, v in spec.items()}


def cast_params(params: dict, cfg: ModelConfig, dtype) -> dict:
    """Casts every "weight" leaf to dtype; fp32 and int leaves keep theirs (a QuantizedWeight
    keeps its stored values and takes dtype as its compute dtype)."""
    return map_spec(lambda path, leaf: _get(params, path).astype(leaf_dtype(leaf[1], dtype)), param_spec(cfg))


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree
