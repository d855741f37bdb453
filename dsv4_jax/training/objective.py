"""The losses DeepSeek-V4 is trained with, on a batch of token windows.

* next-token cross-entropy of the main model;
* the MTP block's cross-entropy for the token two positions on (its input: the main model's
  final hidden streams at t and the token at t + 1), weighted by `mtp_weight` (DeepSeek-V3 §2.2
  uses lambda = 0.3, then 0.1);
* the lightning indexer's KL to the main attention's distribution over the compressed entries
  it chooses (`indexer.distillation_kl`, DeepSeek-V3.2 §2.1), averaged over the layers that choose.
  Its inputs are held constant in the model, so it trains the indexer alone while the
  cross-entropies train everything else. A dense warm-up is the same loss with index_topk at the
  number of entries (every visible entry chosen, as the warm-up stage of V3.2 attends densely).

`params` is the trainable tree {"main": the model's parameter tree without tid2eid, "mtp": the
MTP block's (absent without one)}; `frozen` holds tid2eid (hash routing is a fixed table).

Expert balance is not a loss: the gate biases only select experts (their gradient is zero), and
`balanced` moves them against each expert's load after every step, DeepSeek-V3's auxiliary-loss-
free balancing (§2.1.2; bias update speed gamma = 0.001).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.model.cache import init_cache
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.deepseek_v4 import step
from dsv4_jax.model.mtp import init_mtp_cache, mtp_step


def cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean next-token cross-entropy (nats) of fp32 logits `[B, T, V]` against int targets `[B, T]`."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def losses(params: dict, frozen: dict, windows: jnp.ndarray, cfg: ModelConfig) -> tuple[dict, jnp.ndarray]:
    """The losses of windows int32 `[B, S + 1]` (inputs the first S tokens, targets the last S):
    ({"lm": main cross-entropy, "mtp": the MTP block's (0 without one), "indexer": mean indexer KL
    over the layers that choose (0 without any)}, fp32 scalars; the main model's choices per
    expert int32 `[L, E]`). cfg runs with attention_impl "ref" (the kernels have no reverse mode)."""
    B, S1 = windows.shape
    inputs, targets = windows[:, :-1], windows[:, 1:]
    main = {**params["main"], **frozen}
    out = step(main, init_cache(cfg, B, S1 - 1, main["embed"].dtype), inputs, cfg, return_hidden=True,
               indexer_kl=True, expert_load=True)
    kl = out.indexer_kl
    chose = ~jnp.isnan(kl)
    result = {"lm": cross_entropy(out.logits, targets),
              "indexer": jnp.sum(jnp.where(chose, kl, 0.0)) / jnp.maximum(jnp.sum(chose), 1),
              "mtp": jnp.float32(0.0)}
    if "mtp" in params:
        mtp_cache = init_mtp_cache(cfg, B, main["embed"].dtype)
        mtp_logits, _, _ = mtp_step(params["mtp"], main["embed"], main["head"], mtp_cache, out.hidden[:, :-1],
                                    targets[:, :-1], cfg)
        result["mtp"] = cross_entropy(mtp_logits, targets[:, 1:])
    return result, out.expert_load


def total(parts: dict, mtp_weight: float) -> jnp.ndarray:
    """The loss the optimizer lowers: lm + mtp_weight * mtp + indexer."""
    return parts["lm"] + mtp_weight * parts["mtp"] + parts["indexer"]


def balanced(gate_bias: jnp.ndarray, load: jnp.ndarray, cfg: ModelConfig, rate: float) -> jnp.ndarray:
    """The learned-routing layers' gate biases `[L_learned, E]` after one step of auxiliary-loss-free
    balancing: each expert's bias raised by `rate` when it took fewer than its layer's mean
    choices in `load` (`[L, E]`, every layer's), lowered by `rate` when it took more."""
    learned = load[~np.asarray(cfg.hash_layers, bool)].astype(jnp.float32)  # gate_bias's rows, in order
    return gate_bias + rate * jnp.sign(jnp.mean(learned, axis=-1, keepdims=True) - learned).astype(gate_bias.dtype)


def max_violation(load: jnp.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Per learned-routing layer, how far its busiest expert is over an even share: max load /
    mean load - 1 (0: perfectly even), from choices per expert `[L, E]`."""
    learned = np.asarray(load)[~np.asarray(cfg.hash_layers, bool)].astype(np.float64)
    return learned.max(-1) / np.maximum(learned.mean(-1), 1e-9) - 1
