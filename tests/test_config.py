"""ModelConfig.from_hf: both config forms, the published configs, and errors naming the field."""

import json

import pytest

from dsv4_jax import ConfigError, ModelConfig
from hf_oracle import TINY, hf_config

FLASH = {  # DeepSeek-V4-Flash config.json (official legacy form), values from the model card
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024,
    "o_groups": 8, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 3, "swiglu_limit": 10.0,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
PRO = dict(FLASH, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
           o_groups=16, index_topk=1024, n_routed_experts=384, moe_intermediate_size=3072,
           routed_scaling_factor=2.5, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])


def test_flash_and_pro():
    f = ModelConfig.from_hf(FLASH)
    assert f.num_layers == 43 and len(f.compress_ratios) == 43
    assert f.layers_of_ratio(4) == tuple(range(2, 43, 2)) and len(f.layers_of_ratio(128)) == 20
    assert f.hash_layers[:4] == (True, True, True, False) and f.num_hash_layers == 3
    assert f.yarn.factor == 16 and f.yarn.original_max_position_embeddings == 65536
    assert f.rope_head_dim == 64 and f.nope_head_dim == 448
    p = ModelConfig.from_hf(PRO)
    assert p.num_layers == 61 and p.compress_ratios[:3] == (128, 128, 4) and len(p.layers_of_ratio(4)) == 30
    assert hash(f) != hash(p)


def test_transformers_form_equals_legacy_form(tmp_path):
    """transformers folds the legacy keys into layer_types / mlp_layer_types / rope_parameters;
    its written config.json must read back as the same ModelConfig."""
    cfg = hf_config(TINY)
    cfg.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in written and "compress_ratios" not in written
    ours_new = ModelConfig.from_hf(tmp_path)  # a directory
    ours_file = ModelConfig.from_hf(tmp_path / "config.json")  # a file
    ours_legacy = ModelConfig.from_hf(TINY)  # a dict
    assert ours_new == ours_file == ours_legacy


def test_ratio_one_means_window_only():
    c = ModelConfig.from_hf(TINY)
    assert TINY["compress_ratios"][4] == 1 and c.compress_ratios[4] == 0


def test_roundtrip_dict():
    c = ModelConfig.from_hf(FLASH)
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("change, field", [
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [3, 0]}, "compress_ratios[42]"),
    ({"compress_ratios": [0, 4, 128]}, "compress_ratios"),
    ({"qk_rope_head_dim": 1024}, "qk_rope_head_dim"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"o_groups": 7}, "o_groups"),
    ({"num_attention_heads": 0}, "num_heads"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"num_hash_layers": 50}, "num_hash_layers"),
    ({"hidden_size": "4096"}, "hidden_size"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"rope_scaling": {"type": "longrope", "factor": 2}}, "rope_scaling.type"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4}}, "factor"),
    ({"layer_types": ["sliding_attention"] * 42 + ["dense"]}, "layer_types[42]"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"mlp_layer_types": ["moe"] * 42 + ["dense"]}, "mlp_layer_types[42]"),
])
def test_invalid_configs_name_the_field(change, field):
    bad = dict(FLASH, **change)
    with pytest.raises(ConfigError, match=r"`?" + field.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_hf(bad)


def test_missing_field_and_bad_file(tmp_path):
    d = dict(FLASH)
    del d["head_dim"]
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig.from_hf(d)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_hf(tmp_path / "nowhere")
