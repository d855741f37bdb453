"""The test configs, and random transformers models (dsv4_jax.tools.hf_reference: every parameter
randomised) saved as HF checkpoints our loader reads."""

from __future__ import annotations

import torch

from dsv4_jax.tools.hf_reference import hf_config, make_model, randomize  # noqa: F401  (used by the tests)

TINY = dict(  # head_dim 32, rope 8, window 8, 7 layers mixing 0/4/128, hash and learned MoE
    vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=7,
    num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8,
    sliding_window=8, index_n_heads=16, index_head_dim=16, index_topk=4,
    compress_ratios=[0, 4, 128, 4, 1, 128, 4, 0], num_nextn_predict_layers=1,
    num_hash_layers=2, n_routed_experts=8, num_experts_per_tok=2, hc_mult=4, hc_sinkhorn_iters=20,
    routed_scaling_factor=1.5, swiglu_limit=0.5, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                  "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1024, tie_word_embeddings=False,
)

# Flash's attention geometry (head_dim 512, rope 64, window 128, YaRN 16 over 65536, index
# heads of 128) on a narrow, shallow body.
FLASH_SHAPED = dict(
    vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=512, qk_rope_head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=32,
    sliding_window=128, index_n_heads=16, index_head_dim=128, index_topk=16,
    compress_ratios=[0, 4, 128, 4, 0], num_nextn_predict_layers=1,
    num_hash_layers=1, n_routed_experts=8, num_experts_per_tok=2, hc_mult=4, hc_sinkhorn_iters=20,
    routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                  "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1048576, tie_word_embeddings=False,
)


def save(model, d: dict, directory: str) -> None:
    """save_pretrained (transformers' hybrid naming and new-form config)."""
    model.save_pretrained(directory)


@torch.no_grad()
def logits(model, ids) -> "torch.Tensor":
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float()
