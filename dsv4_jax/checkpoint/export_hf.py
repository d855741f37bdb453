"""Our parameter tree -> an HF-style checkpoint directory in the official naming (config.json in
the official legacy form, safetensors shards with an index). Used to make checkpoints on the
spot for the demo and the tests."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.quantized import is_quantized
from . import quant
from .names import checkpoint_layout, mtp_checkpoint_layout
from .safetensors_io import write_safetensors


def official_config(cfg: ModelConfig) -> dict:
    """The config.json of the published checkpoints (legacy form) describing cfg."""
    d = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.sliding_window,
        "compress_ratios": list(cfg.compress_ratios) + [0] * cfg.num_nextn_predict_layers,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "num_hash_layers": cfg.num_hash_layers, "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": 1,
        "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    if cfg.hash_layers != tuple(i < cfg.num_hash_layers for i in range(cfg.num_layers)):
        raise ValueError("the official config form can only express hash layers as a prefix")
    if cfg.yarn is not None:
        d["rope_scaling"] = {"type": "yarn", "factor": cfg.yarn.factor,
                             "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
                             "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow}
    return d


# Linears the published checkpoints store in FP8 (128x128 block scales); routed experts are FP4.
FP8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "e_proj", "h_proj")


def official_tensors(params: dict, cfg: ModelConfig, *, mtp_block: bool = False) -> dict[str, np.ndarray]:
    """The main model's tensors by official name (numpy arrays, as the tree holds them; a
    QuantizedWeight dequantized to float32); with `mtp_block`, those of the MTP block's tree
    (mtp.mtp_param_spec's, e.g. `load_mtp_params`'), `mtp.0.*`."""
    out = {}
    for name, (path, index) in (mtp_checkpoint_layout if mtp_block else checkpoint_layout)(cfg).items():
        leaf = params
        for k in path:
            leaf = leaf[k]
        leaf = leaf[index] if index else leaf
        out[name] = np.asarray(leaf.dequantize(jnp.float32) if is_quantized(leaf) else leaf)
    return out


def write_hf_checkpoint(params: dict, cfg: ModelConfig, directory: str, *, num_shards: int = 1,
                        dtype=ml_dtypes.bfloat16, quantize: bool = False,
                        mtp: dict[str, np.ndarray] | None = None) -> None:
    """Writes params under their official names; float weights in `dtype`, except the tensors
    the published checkpoints keep in fp32 (hc_*, attn_sink, ape, gate.bias). With quantize,
    as the published checkpoints store them: FP8 e4m3 linears with E8M0 `.scale` per 128x128
    block, FP4 e2m1 routed experts packed two per byte with E8M0 scales per 32 inputs. `mtp`:
    the `mtp.*` tensors by official name (float arrays), stored by the same rules (e_proj and
    h_proj FP8); only for a cfg with num_nextn_predict_layers > 0."""
    if mtp and not cfg.num_nextn_predict_layers:
        raise ValueError("mtp tensors given for a config with num_nextn_predict_layers 0")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(official_config(cfg), f, indent=2)
    tensors = {}
    for name, arr in {**official_tensors(params, cfg), **(mtp or {})}.items():
        base = name[: -len(".weight")]
        if arr.dtype.kind in "iu":
            arr = arr.astype(np.int64)
        elif quantize and any(name.endswith(f".{leaf}.weight") for leaf in FP8_LINEARS):
            arr, tensors[base + ".scale"] = quant.quantize_fp8(arr.astype(np.float32))
        elif quantize and ".ffn.experts." in name:
            arr, tensors[base + ".scale"] = quant.quantize_fp4(arr.astype(np.float32))
        elif name.rsplit(".", 1)[-1] in ("attn_sink", "ape", "bias") or name.rsplit(".", 1)[-1].startswith("hc_"):
            arr = arr.astype(np.float32)
        else:
            arr = arr.astype(np.float32).astype(dtype)
        tensors[name] = arr
    names = list(tensors)
    per = -(-len(names) // num_shards)
    weight_map = {}
    for s in range(num_shards):
        chunk = names[s * per:(s + 1) * per]
        fname = "model.safetensors" if num_shards == 1 else f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        write_safetensors(os.path.join(directory, fname), {n: tensors[n] for n in chunk})
        weight_map.update({n: fname for n in chunk})
    if num_shards > 1:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
