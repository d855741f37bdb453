"""The published DeepSeek-V4 configs at full size, by name, for planning without a checkpoint.

Each is the `config.json` a checkpoint ships (official spelling, read by `ModelConfig.from_hf`),
with the values ../shared/docs/architecture.md gives: Flash §1.1 (verbatim), Pro §1.4 (the keys
that differ from Flash; every other value as in Flash). `compress_ratios` carries the MTP
block's trailing 0, as the published files do.

    cfg = preset("flash")            # a ModelConfig
"""

from __future__ import annotations

from .config import ModelConfig

FLASH = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    # layers 0, 1 window only; 2, 4, .., 42 ratio 4; 3, 5, .., 41 ratio 128; then the MTP block
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 3,
    "swiglu_limit": 10.0,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

PRO = {
    **FLASH,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "o_groups": 16,
    "index_topk": 1024,
    "n_routed_experts": 384,
    "moe_intermediate_size": 3072,
    "routed_scaling_factor": 2.5,
    # layers 0, 1 ratio 128; 2, 4, .., 60 ratio 4; 3, 5, .., 59 ratio 128; then the MTP block
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}

PRESETS = {"flash": FLASH, "pro": PRO}


def preset(name: str) -> ModelConfig:
    """The full-size ModelConfig of a published model ("flash" or "pro")."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig.from_hf(PRESETS[name])
