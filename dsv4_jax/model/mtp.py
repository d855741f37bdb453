"""DeepSeek-V4's multi-token-prediction block `mtp.0` (architecture.md §9), as the checkpoint
defines it: the draft model of speculative decoding.

Given the main model's final hidden streams at position t (before its hyper-connection head,
`model.step(..., return_hidden=True)`) and the token at t + 1, the block predicts the token at
t + 2:

    e = enorm(embed[next_ids])                        [B, T, D]     (the main model's embed)
    h = hnorm(hidden)                                 [B, T, hc, D] (per stream)
    X = e_proj(e) broadcast to every stream + h_proj(h)
    X = Block(X)   one window-only layer: rope_theta without YaRN, learned routing with its gate
                   bias (never hash-routed), its own window ring
    logits = head(norm(hc_head(X)))                   (its own hc head and norm, the shared head)

For k drafts the block runs again on its own output streams X. Its attention at position t sees
its own keys of positions t - W + 1 .. t, so it keeps a cache of its own, advanced like the
main model's (per-row positions).

No embedding is zeroed: vLLM zeroes the block's input embedding at position 0, but architecture.md
§9's forward (the published reference does not run the block) has no such step, so here the
embedding term is always e_proj(enorm(embed)). It only touches the block's own key at position 0.

The block runs through the main model's layer code: its weights, viewed as the stack of a
one-layer model (`block_config`, `layer_params`), go through `model.run_layers`, and its head is
`model.lm_logits`. Its cache is that one-layer model's cache, `{"pos": int32 [B], "window":
{"ring": [1, B, W + lookahead, Dh]}}` (kv_cache_dtype "fp8": FP8 record words `[1, B, W +
lookahead, R / 4]`), so cache.reset_rows / take_rows / put_rows work on it as they are.

Parameter tree (unstacked; the block's leaves are named as a main layer's are, in the tree of
dsv4_jax/model/params.py):

    attn_norm [D], ffn_norm [D]
    hc_attn / hc_ffn {fn [(2+hc)*hc, hc*D], base [(2+hc)*hc], scale [3]}
    attn {wq_a [Q, D], q_norm [Q], wq_b [H*Dh, Q], wkv [Dh, D], kv_norm [Dh], wo_a [G*O, H*Dh/G],
          wo_b [D, G*O], sink [H]}
    ffn {gate [E, D], gate_bias [E], w1 [E, I, D], w2 [E, D, I], w3 [E, I, D],
         shared_w1 [I, D], shared_w2 [D, I], shared_w3 [I, D]}
    enorm [D], hnorm [D], e_proj [D, D], h_proj [D, D], norm [D],
    hc_head {fn [hc, hc*D], base [hc], scale [1]}

The leaves of `NATIVE_QUANT` may be `QuantizedWeight`s (a `--dtype native` conversion: FP8
linears, e_proj and h_proj included, FP4 routed experts), exactly as in the main layers; wo_a
is always a float array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.numerics import rms_norm
from .cache import init_cache
from .config import ModelConfig
from .layer_kinds import WINDOW
from .deepseek_v4 import lm_logits, run_layers
from .linear import dense
from .params import F32, NATIVE_QUANT as _MAIN_NATIVE_QUANT, WEIGHT, init_params, leaf_dtype, map_spec, param_spec

PREFIX = "mtp.0."  # the block's tensors in the checkpoint
EXTRAS = ("enorm", "hnorm", "e_proj", "h_proj")  # what the block adds to a main layer (besides its head)

# Leaves reached only through `linear.dense` / `moe.routed_experts`, with their published format.
NATIVE_QUANT: dict[tuple[str, ...], str] = {
    **{path[1:]: fmt for path, fmt in _MAIN_NATIVE_QUANT.items() if path[0] == "layers"},
    ("e_proj",): "fp8", ("h_proj",): "fp8",
}


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The one-layer model the block runs as: one window-only layer (ratio 0: rope_theta, no
    YaRN) with learned routing, the rest of cfg as it is."""
    return cfg.replace(num_layers=1, compress_ratios=(WINDOW,), hash_layers=(False,), num_nextn_predict_layers=0,
                       use_index_cache=False, index_topk_freq=1, index_topk_pattern=None,
                       index_cache_skip_compressor=False)


def mtp_param_spec(cfg: ModelConfig) -> dict:
    """The block's parameter tree (module doc) with leaves `(shape, dtype class)`, as
    params.param_spec."""
    spec = param_spec(block_config(cfg))
    tree = map_spec(lambda path, leaf: (leaf[0][1:], leaf[1]), spec["layers"])  # a layer, unstacked
    tree["ffn"]["gate_bias"] = (spec["gate_bias"][0][1:], F32)
    D = cfg.hidden_size
    return {**tree, "enorm": ((D,), F32), "hnorm": ((D,), F32), "e_proj": ((D, D), WEIGHT),
            "h_proj": ((D, D), WEIGHT), "norm": spec["norm"], "hc_head": spec["hc_head"]}


def init_mtp_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.05) -> dict:
    """Random block parameters with every leaf non-trivial (sinks, gate bias, hc base / scale
    included; params.init_params's rules), for tests and demos."""
    one = init_params(block_config(cfg), seed=seed, dtype=dtype, std=std)
    tree = jax.tree.map(lambda a: a[0], one["layers"])
    tree["ffn"]["gate_bias"] = one["gate_bias"][0]
    rng = np.random.default_rng([seed, 1])
    D = cfg.hidden_size
    for name in ("enorm", "hnorm"):
        tree[name] = jnp.asarray(1.0 + 0.1 * rng.standard_normal(D), jnp.float32)
    for name in ("e_proj", "h_proj"):
        tree[name] = jnp.asarray(std * rng.standard_normal((D, D)), leaf_dtype(WEIGHT, dtype))
    return {**tree, "norm": one["norm"], "hc_head": one["hc_head"]}


def layer_params(mtp_params: dict) -> dict:
    """The block as the parameters of the one-layer model (`block_config`) that `model.run_layers`
    takes: its layer's leaves stacked `[1, ...]` under "layers", its gate bias as `gate_bias`
    `[1, E]`."""
    layer = {k: mtp_params[k] for k in ("attn_norm", "ffn_norm", "hc_attn", "hc_ffn", "attn")}
    layer["ffn"] = {k: v for k, v in mtp_params["ffn"].items() if k != "gate_bias"}
    return {"layers": jax.tree.map(lambda a: a[None], layer), "gate_bias": mtp_params["ffn"]["gate_bias"][None]}


def init_mtp_cache(cfg: ModelConfig, batch: int, dtype=jnp.float32, lookahead: int = 0,
                   kv_cache_dtype: str = "auto") -> dict:
    """The block's cache for `batch` rows: its window ring (`lookahead` slots wider for the drafts a
    verification may reject; with kv_cache_dtype "fp8" FP8 records, as the main model's rings:
    dsv4_jax/model/cache.py) and positions."""
    return init_cache(block_config(cfg), batch, cfg.sliding_window, dtype, lookahead, kv_cache_dtype=kv_cache_dtype)


def mtp_step(mtp_params: dict, embed: jnp.ndarray, head: jnp.ndarray, mtp_cache: dict, hidden: jnp.ndarray,
             next_ids: jnp.ndarray, cfg: ModelConfig, n_valid: jnp.ndarray | None = None):
    """Runs the block on a chunk of T positions per row, row b at positions mtp_cache["pos"][b] ..

    hidden `[B, T, hc, D]`: the main model's final hidden streams (before its hc head) at those
    positions, or the block's own output streams for a further draft; next_ids int `[B, T]`: the
    token at the position after each (the one the main model sampled or was given). embed and
    head `[V, D]`: the main model's. n_valid int32 `[B]` as in `model.step` (default T; padding
    is neither stored nor advancing; 0: the row holds). Returns (fp32 logits `[B, T, V]` for the
    token two positions on, the block's output streams `[B, T, hc, D]` (the next draft's
    `hidden`), the cache with the chunk added)."""
    eps = cfg.rms_norm_eps
    e = rms_norm(embed[next_ids], mtp_params["enorm"], eps)
    h = rms_norm(hidden, mtp_params["hnorm"], eps)
    x = dense(e, mtp_params["e_proj"], cfg)[:, :, None, :] + dense(h, mtp_params["h_proj"], cfg)
    streams, new_cache, _, _ = run_layers(layer_params(mtp_params), mtp_cache, x, next_ids, block_config(cfg), n_valid)
    logits = lm_logits(streams, mtp_params["hc_head"], mtp_params["norm"], head, cfg)
    return logits, streams, new_cache
