"""Random DeepSeek-V4 models in transformers (the parity oracle), shared by the tests and the
benchmark. Needs torch and transformers (the `test` extra); imported only where used.

transformers initialises sinks, `ape` (position_bias), gate bias, hc base/scale and tid2eid to
trivial values; here every parameter and buffer is randomised, tid2eid with k distinct valid
experts per token, so no code path is hidden behind a zero or a one.
"""

from __future__ import annotations


def hf_config(d: dict):
    """A DeepseekV4Config from a legacy-form dict (ratio 1 written as 0, which transformers knows)."""
    from transformers import DeepseekV4Config

    d = dict(d)
    d["compress_ratios"] = [0 if r == 1 else r for r in d["compress_ratios"]]
    return DeepseekV4Config(**d)


def randomize(model, seed: int = 0, std: float = 0.08) -> None:
    """Sets every parameter and buffer of a transformers DeepSeek-V4 (sub)module at random;
    `model.config` supplies the tid2eid shape."""
    import torch

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                keys = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g)
                t.copy_(keys.argsort(dim=-1)[:, : cfg.num_experts_per_tok])
            elif "norm" in name or name.endswith("scale"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith(("sinks", "base", "position_bias", "e_score_correction_bias", "hc_base")):
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif t.is_floating_point():
                t.copy_(std * torch.randn(t.shape, generator=g))


def make_model(d: dict, seed: int = 0, std: float = 0.08):
    """A transformers DeepseekV4ForCausalLM in fp32, eval mode, every parameter randomised."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(d)).float().eval()
    randomize(model, seed, std)
    return model
