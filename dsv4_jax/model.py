"""The whole model: embedding, the layer stack, the hyper-connection head and the LM head.

The stack is one `lax.scan` over layers. The body dispatches with `lax.switch` on the layer's
kind (window only, ratio 4, ratio 128); each kind's own weights live in their own stack
(`params["csa"]`, `params["hca"]`) and a layer reaches them through its kind-local index,
carried in the scan's xs. Weights every layer has (`params["layers"]`) are scanned over.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import attention
from .config import CSA, HCA, WINDOW, ModelConfig
from .hyper_connection import hc_head, hc_post, hc_pre
from .linear import dense
from .moe import learned_choice, route, routed_experts, router_scores, shared_expert
from .norms import rms_norm
from .rope import cos_sin, layer_inv_freqs


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    """Static per-layer dispatch data derived from the config (numpy, length L each)."""

    kinds: tuple[int, ...]  # the compress ratios present, in switch-branch order
    branch: np.ndarray  # index into `kinds`
    kind_local: np.ndarray  # index into the layer's kind stack (0 for window-only layers)
    compressed_rope: np.ndarray  # 1: compress theta + YaRN (ratio 4/128), 0: plain theta (window only)
    is_hash: np.ndarray  # routed through tid2eid
    route_local: np.ndarray  # index into tid2eid (hash layers) or gate_bias (learned layers)

    @classmethod
    def of(cls, cfg: ModelConfig) -> "LayerSchedule":
        kinds = tuple(k for k in (WINDOW, CSA, HCA) if k in cfg.compress_ratios)
        ratios = np.array(cfg.compress_ratios)
        local = np.zeros_like(ratios)
        for k in (CSA, HCA):
            local[ratios == k] = np.arange(int(np.sum(ratios == k)))
        is_hash = np.array(cfg.hash_layers, dtype=bool)
        route_local = np.where(is_hash, np.cumsum(is_hash) - 1, np.cumsum(~is_hash) - 1)
        return cls(kinds, np.array([kinds.index(r) for r in ratios], np.int32), local.astype(np.int32),
                   (ratios != WINDOW).astype(np.int32), is_hash, route_local.astype(np.int32))


def _take(tree, i):
    """Row i of every stacked leaf of tree."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _moe(params: dict, layer: dict, x: jnp.ndarray, ids: jnp.ndarray, is_hash, route_local,
         cfg: ModelConfig) -> jnp.ndarray:
    """MoE of one layer on x `[B, S, D]` (already ffn-normed); ids `[B, S]` for hash routing."""
    B, S, D = x.shape
    f = layer["ffn"]
    xt = x.reshape(B * S, D)
    scores = router_scores(xt, f["gate"])
    k = cfg.num_experts_per_tok
    if "tid2eid" in params and "gate_bias" in params:
        experts = jax.lax.cond(
            is_hash,
            lambda: _take(params["tid2eid"], route_local)[ids.reshape(-1)],
            lambda: learned_choice(scores, _take(params["gate_bias"], route_local), k))
    elif "tid2eid" in params:
        experts = _take(params["tid2eid"], route_local)[ids.reshape(-1)]
    else:
        experts = learned_choice(scores, _take(params["gate_bias"], route_local), k)
    weights = route(scores, experts, cfg.routed_scaling_factor)
    routed = routed_experts(xt, experts, weights, f["w1"], f["w2"], f["w3"], cfg.swiglu_limit)
    shared = shared_expert(xt, f["shared_w1"], f["shared_w2"], f["shared_w3"], cfg.swiglu_limit)
    return (routed + shared.astype(jnp.float32)).astype(x.dtype).reshape(B, S, D)


def forward(params: dict, input_ids: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """Full-sequence forward from position 0, no cache: int `[B, S]` -> fp32 logits `[B, S, V]`."""
    B, S = input_ids.shape
    sched = LayerSchedule.of(cfg)
    window_freqs, compress_freqs = (jnp.asarray(f) for f in layer_inv_freqs(cfg))
    positions = jnp.arange(S)
    rope_tables = jnp.stack([jnp.stack(cos_sin(positions, window_freqs)),
                             jnp.stack(cos_sin(positions, compress_freqs))])  # [2, 2, S, rope/2]
    window_idx = jnp.broadcast_to(attention.window_indices(S, cfg.sliding_window), (B, S, min(S, cfg.sliding_window)))

    def window_branch(q, kv, x, c_q, cos, sin, local, sink):
        return attention.attend(q, kv, window_idx, sink, cfg)

    def compressed_branch(ratio):
        def branch(q, kv, x, c_q, cos, sin, local, sink):
            own = _take(params["csa" if ratio == CSA else "hca"], local)
            n = S // ratio
            if n == 0:  # no complete block yet: window only
                return attention.attend(q, kv, window_idx, sink, cfg)
            entries = attention.compress_blocks(own["compressor"], x, ratio, compress_freqs, cfg)
            if ratio == CSA:
                chosen = attention.indexer_topk(own["indexer"], x, c_q, cos, sin, compress_freqs, cfg)
            else:
                chosen = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, S, n))
                visible = chosen < ((positions + 1) // ratio)[None, :, None]
                chosen = jnp.where(visible, chosen, -1)
            indices = jnp.concatenate([window_idx, jnp.where(chosen >= 0, chosen + S, -1)], axis=-1)
            return attention.attend(q, jnp.concatenate([kv, entries], axis=1), indices, sink, cfg)
        return branch

    branches = [window_branch if k == WINDOW else compressed_branch(k) for k in sched.kinds]

    def body(h, xs):
        layer, branch, local, compressed_rope, is_hash, route_local = xs
        cos, sin = rope_tables[compressed_rope]
        hc_args = dict(hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

        u, post, comb = hc_pre(h, **layer["hc_attn"], **hc_args)
        x = rms_norm(u, layer["attn_norm"], cfg.rms_norm_eps)
        a = layer["attn"]
        q, c_q = attention.query(a, x, cos, sin, cfg)
        kv = attention.key_value(a, x, cos, sin, cfg)
        o = jax.lax.switch(branch, branches, q, kv, x, c_q, cos, sin, local, a["sink"])
        h = hc_post(attention.output(a, o, cos, sin, cfg), h, post, comb)

        u, post, comb = hc_pre(h, **layer["hc_ffn"], **hc_args)
        x = rms_norm(u, layer["ffn_norm"], cfg.rms_norm_eps)
        h = hc_post(_moe(params, layer, x, input_ids, is_hash, route_local, cfg), h, post, comb)
        return h, None

    x = params["embed"][input_ids]
    h = jnp.broadcast_to(x[:, :, None, :], (B, S, cfg.hc_mult, cfg.hidden_size))
    xs = (params["layers"], jnp.asarray(sched.branch), jnp.asarray(sched.kind_local),
          jnp.asarray(sched.compressed_rope), jnp.asarray(sched.is_hash), jnp.asarray(sched.route_local))
    h, _ = jax.lax.scan(body, h, xs)
    y = hc_head(h, params["hc_head"]["fn"], params["hc_head"]["base"], params["hc_head"]["scale"],
                hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    y = rms_norm(y, params["norm"], cfg.rms_norm_eps)
    return dense(y.astype(jnp.float32), params["head"].astype(jnp.float32))


@struct.dataclass
class Model:
    """A DeepSeek-V4 model: `logits = model(input_ids)` for int32 `[B, S]` -> fp32 `[B, S, V]`."""

    params: dict
    config: ModelConfig = struct.field(pytree_node=False)

    def __call__(self, input_ids) -> jnp.ndarray:
        return _jit_forward(self.params, jnp.asarray(input_ids, jnp.int32), self.config)

    @property
    def dtype(self):
        return self.params["embed"].dtype


@partial(jax.jit, static_argnums=2)
def _jit_forward(params, input_ids, cfg):
    return forward(params, input_ids, cfg)
