"""Checkpoint tensor names <-> places in our parameter tree.

Two namings reach us:

* the official one of the published checkpoints: `embed.weight`, `head.weight`, `norm.weight`,
  `hc_head_fn`, `layers.N.attn.kv_norm.weight`, `layers.N.ffn.experts.E.w1.weight`, ...;
* the hybrid one transformers' `save_pretrained` writes: the same leaves under a `model.`
  prefix, except `model.embed_tokens.weight`, `model.norm.weight`,
  `model.hc_head.hc_fn|hc_base|hc_scale`, and `model.layers.N.attn.norm.weight` for the kv norm.

`official_name` folds the hybrid naming into the official one; `checkpoint_layout(cfg)` lists
every official name the model needs with where it goes: `(path in the parameter tree, index
into the stacked leading axes)`.
"""

from __future__ import annotations

import re

from dsv4_jax.model import mtp
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.layer_kinds import BY_RATIO, COMPRESSED

_HYBRID_TOP = {
    "embed_tokens.weight": "embed.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_HYBRID_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")
_MTP = re.compile(r"^(model\.)?mtp\.")


def is_mtp(name: str) -> bool:
    """Tensors of the multi-token-prediction block(s), kept aside from the main model."""
    return bool(_MTP.match(name))


def official_name(name: str) -> str:
    """Maps a tensor name in either naming to the official one (official names pass through)."""
    if name.startswith("model."):
        name = name[len("model."):]
        if name in _HYBRID_TOP:
            return _HYBRID_TOP[name]
        m = _HYBRID_KV_NORM.match(name)
        if m:
            return f"{m.group(1)}.kv_norm.weight"
        return name
    return name


def _compressor(prefix: str, path: tuple, i: int) -> dict:
    return {f"{prefix}.wkv.weight": (path + ("wkv",), (i,)),
            f"{prefix}.wgate.weight": (path + ("wgate",), (i,)),
            f"{prefix}.ape": (path + ("ape",), (i,)),
            f"{prefix}.norm.weight": (path + ("norm",), (i,))}


def checkpoint_layout(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every official tensor name of the main model -> (parameter path, stacked index)."""
    out: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
        "embed.weight": (("embed",), ()),
        "head.weight": (("head",), ()),
        "norm.weight": (("norm",), ()),
        "hc_head_fn": (("hc_head", "fn"), ()),
        "hc_head_base": (("hc_head", "base"), ()),
        "hc_head_scale": (("hc_head", "scale"), ()),
    }
    local = {k.ratio: 0 for k in COMPRESSED}  # layers of each kind so far: the index into its stacks
    n_hash = n_learned = 0
    for i, ratio in enumerate(cfg.compress_ratios):
        p = f"layers.{i}"
        L = ("layers",)
        out[f"{p}.attn_norm.weight"] = (L + ("attn_norm",), (i,))
        out[f"{p}.ffn_norm.weight"] = (L + ("ffn_norm",), (i,))
        for site in ("attn", "ffn"):
            for leaf in ("fn", "base", "scale"):
                out[f"{p}.hc_{site}_{leaf}"] = (L + (f"hc_{site}", leaf), (i,))
        for leaf in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b"):
            out[f"{p}.attn.{leaf}.weight"] = (L + ("attn", leaf), (i,))
        out[f"{p}.attn.attn_sink"] = (L + ("attn", "sink"), (i,))
        kind = BY_RATIO[ratio]
        if kind.ratio:
            j = local[ratio]
            out.update(_compressor(f"{p}.attn.compressor", (kind.name, "compressor"), j))
            if kind.indexer:
                out.update(_compressor(f"{p}.attn.indexer.compressor", (kind.name, "indexer", "compressor"), j))
                out[f"{p}.attn.indexer.wq_b.weight"] = ((kind.name, "indexer", "wq_b"), (j,))
                out[f"{p}.attn.indexer.weights_proj.weight"] = ((kind.name, "indexer", "weights_proj"), (j,))
            local[ratio] += 1
        out[f"{p}.ffn.gate.weight"] = (L + ("ffn", "gate"), (i,))
        if cfg.hash_layers[i]:
            out[f"{p}.ffn.gate.tid2eid"] = (("tid2eid",), (n_hash,))
            n_hash += 1
        else:
            out[f"{p}.ffn.gate.bias"] = (("gate_bias",), (n_learned,))
            n_learned += 1
        for w in ("w1", "w2", "w3"):
            out[f"{p}.ffn.shared_experts.{w}.weight"] = (L + ("ffn", f"shared_{w}"), (i,))
            for e in range(cfg.n_routed_experts):
                out[f"{p}.ffn.experts.{e}.{w}.weight"] = (L + ("ffn", w), (i, e))
    return out


def mtp_checkpoint_layout(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every tensor of the block by its official checkpoint name -> (path in the tree, index into
    the leaf's stacked leading axis: the expert of a routed-expert weight, else ()). The names
    are those of a main layer (dsv4_jax.checkpoint.names.checkpoint_layout of the one-layer model) under
    `mtp.0.`, its top-level norm and hc head included, plus enorm, hnorm, e_proj and h_proj; no
    embed or head (the block shares the main model's)."""
    out = {}
    for name, (path, index) in checkpoint_layout(mtp.block_config(cfg)).items():
        local = mtp.PREFIX + name.removeprefix("layers.0.")
        if path[0] == "layers":
            out[local] = (path[1:], index[1:])
        elif path == ("gate_bias",):
            out[local] = (("ffn", "gate_bias"), ())
        elif path[0] in ("norm", "hc_head"):
            out[local] = (path, ())
    for leaf in mtp.EXTRAS:
        out[f"{mtp.PREFIX}{leaf}.weight"] = ((leaf,), ())
    return out
