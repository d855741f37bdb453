"""The whole model: embedding, the layer stack, the hyper-connection head and the LM head.

The stack is one `lax.scan` over layers. The body dispatches with `lax.switch` on the layer's
kind (window only, ratio 4, ratio 4 reusing the previous top-k under IndexCache, ratio 128);
each kind's own weights and caches live in their own stacks (`params["csa"]`, `cache["hca"]`,
...) and a layer reaches them through its kind-local index, carried in the scan's xs, as it
reaches the weights every layer has (`params["layers"]`) through its layer index (on CPU
`generate` keeps the large ones as one buffer per layer: dsv4_jax/layer_weights.py). The last
computed indexer top-k travels in the scan carry.
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
from .cache import indexer_state_layers, init_cache
from .index_cache import index_cache_schedule
from .layer_weights import PerExpert, take_layer
from .linear import dense
from .moe import learned_choice, route, routed_experts, router_scores, shared_expert
from .norms import rms_norm
from .rope import cos_sin, layer_inv_freqs


BRANCHES = ("window", "csa", "csa_reuse", "hca")  # switch branches, in this order when present


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    """Static per-layer dispatch data derived from the config (numpy, length L each)."""

    branches: tuple[str, ...]  # the branches present, in switch order
    branch: np.ndarray  # index into `branches`
    kind_local: np.ndarray  # index into the layer's kind stacks
    index_local: np.ndarray  # index into the indexer-state stacks (out of range: the layer has none)
    compressed_rope: np.ndarray  # 1: compress theta + YaRN (ratio 4/128), 0: plain theta (window only)
    is_hash: np.ndarray  # routed through tid2eid
    route_local: np.ndarray  # index into tid2eid (hash layers) or gate_bias (learned layers)

    @classmethod
    def of(cls, cfg: ModelConfig) -> "LayerSchedule":
        ratios = np.array(cfg.compress_ratios)
        reusing = set(index_cache_schedule(cfg).reusing)
        names = ["window" if r == WINDOW else "hca" if r == HCA else "csa_reuse" if i in reusing else "csa"
                 for i, r in enumerate(ratios)]
        branches = tuple(b for b in BRANCHES if b in names)
        local = np.zeros_like(ratios)
        for k in (WINDOW, CSA, HCA):
            local[ratios == k] = np.arange(int(np.sum(ratios == k)))
        with_index = indexer_state_layers(cfg)
        index_local = np.array([with_index.index(i) if i in with_index else len(with_index)
                                for i in range(cfg.num_layers)], np.int32)
        is_hash = np.array(cfg.hash_layers, dtype=bool)
        route_local = np.where(is_hash, np.cumsum(is_hash) - 1, np.cumsum(~is_hash) - 1)
        return cls(branches, np.array([branches.index(n) for n in names], np.int32), local.astype(np.int32),
                   index_local, (ratios != WINDOW).astype(np.int32), is_hash, route_local.astype(np.int32))


def _moe(params: dict, layer: dict, layer_index, x: jnp.ndarray, ids: jnp.ndarray, is_hash, route_local,
         cfg: ModelConfig) -> jnp.ndarray:
    """MoE of layer `layer_index` (its weights: `layer`) on x `[B, S, D]` (already ffn-normed);
    ids `[B, S]` for hash routing."""
    B, S, D = x.shape
    f = layer["ffn"]
    xt = x.reshape(B * S, D)
    scores = router_scores(xt, f["gate"])
    k = cfg.num_experts_per_tok
    if "tid2eid" in params and "gate_bias" in params:
        experts = jax.lax.cond(
            is_hash,
            lambda: take_layer(params["tid2eid"], route_local)[ids.reshape(-1)],
            lambda: learned_choice(scores, take_layer(params["gate_bias"], route_local), k))
    elif "tid2eid" in params:
        experts = take_layer(params["tid2eid"], route_local)[ids.reshape(-1)]
    else:
        experts = learned_choice(scores, take_layer(params["gate_bias"], route_local), k)
    weights = route(scores, experts, cfg.routed_scaling_factor)
    stacks = params["layers"]["ffn"]
    if isinstance(stacks["w1"], PerExpert):  # CPU generate: each expert's own buffers
        routed = routed_experts(xt, experts, weights, f["w1"], f["w2"], f["w3"], cfg.swiglu_limit)
    else:  # the chosen experts straight out of the stacks
        routed = routed_experts(xt, experts, weights, stacks["w1"], stacks["w2"], stacks["w3"], cfg.swiglu_limit,
                                layer=layer_index)
    shared = shared_expert(xt, f["shared_w1"], f["shared_w2"], f["shared_w3"], cfg.swiglu_limit)
    return (routed + shared.astype(jnp.float32)).astype(x.dtype).reshape(B, S, D)


def _put_row(stack: jnp.ndarray, rows: jnp.ndarray, layer, slot, write) -> jnp.ndarray:
    """stack `[L, B, N, D]` with rows `[B, 1, D]` at [layer, :, slot] where `write`, else as it was.
    A decode step's single row per sequence goes in as an in-place update of those B rows rather
    than the general scatter (`.at[...].set(mode="drop")`): the cache writes of a batch-8
    flash-mini step took 0.92-0.94 ms in the profile that way, 0.36-0.38 ms this way."""
    start = (layer, 0, slot, 0)
    old = jax.lax.dynamic_slice(stack, start, (1,) + rows.shape)
    return jax.lax.dynamic_update_slice(stack, jnp.where(write, rows[None].astype(stack.dtype), old), start)


def step(params: dict, cache: dict, input_ids: jnp.ndarray, cfg: ModelConfig, last_only: bool = False,
         measure_reuse: bool = False):
    """Runs T tokens per row through the model at positions cache["pos"] .. + T - 1.

    input_ids int `[B, T]`. Returns (fp32 logits `[B, T, V]`, or `[B, 1, V]` for the last
    position with last_only; the cache with the chunk added). Prefill (any T, chunks of any
    size) and decode (T = 1) are the same computation; the caller keeps pos + T <= max_len.
    With measure_reuse, IndexCache's reusing layers also compute their own top-k (not used) and
    a third output `[L]` gives, per layer, the mean fraction of its own selection that the
    reused one contains (NaN for layers that do not reuse).
    """
    B, T = input_ids.shape
    sched = LayerSchedule.of(cfg)
    W = cfg.sliding_window
    p0 = cache["pos"]
    window_freqs, compress_freqs = (jnp.asarray(f) for f in layer_inv_freqs(cfg))
    positions = p0 + jnp.arange(T, dtype=jnp.int32)
    rope_tables = jnp.stack([jnp.stack(cos_sin(positions, window_freqs)),
                             jnp.stack(cos_sin(positions, compress_freqs))])  # [2, 2, T, rope/2]

    n_keep = min(T, W)
    n4, n128 = (T + CSA - 1) // CSA, (T + HCA - 1) // HCA
    groups = [g for g in ("window", "csa", "indexer", "hca") if g in cache]  # cache groups, payload order

    def state_row(group: str) -> bool:
        """Whether the group's state payload is one row (decode without overlap: compress_chunk)."""
        return T == 1 and group == "hca"

    def nothing(group: str) -> dict:
        """The payload of a group this branch does not write: zeros, no entry to store."""
        c = cache[group]
        out = {k: jnp.zeros(v.shape[1:2] + (1,) + v.shape[3:] if state_row(group) else v.shape[1:], v.dtype)
               for k, v in c.items() if k.startswith("state_")}
        if "ring" in c:
            out["ring_rows"] = jnp.zeros((B, n_keep, cfg.head_dim), c["ring"].dtype)
        if "pool" in c:
            out["entries"] = jnp.zeros((B, n128 if group == "hca" else n4, c["pool"].shape[-1]), c["pool"].dtype)
            out["n_new"] = jnp.int32(0)
        return out

    def payloads(own: dict) -> tuple:
        return tuple(own.get(g) or nothing(g) for g in groups)

    def window_branch(q, kv, x, c_q, cos, sin, local, index_local, sink, caches, last_ids):
        ring = caches["window"]["ring"][local]
        o = attention.attend(q, ring, kv, None, None, sink, p0, cfg)
        return o, last_ids, payloads({"window": {"ring_rows": kv[:, T - n_keep:]}}), jnp.float32(jnp.nan)

    def csa(reuse: bool):
        def branch(q, kv, x, c_q, cos, sin, local, index_local, sink, caches, last_ids):
            own, c = take_layer(params["csa"], local), take_layer(caches["csa"], local)
            entries, n_new, sa, sz = attention.compress_chunk(
                own["compressor"], x, c["state_a"], c["state_z"], p0, CSA, compress_freqs, cfg)
            out = {"csa": {"ring_rows": kv[:, T - n_keep:], "entries": entries, "n_new": n_new,
                           "state_a": sa, "state_z": sz}}
            overlap = jnp.float32(jnp.nan)
            if reuse:  # IndexCache: the previous computing layer's entries, this layer's rows
                ids = last_ids
                if measure_reuse:
                    ci = take_layer(caches["indexer"], index_local)
                    own_ids = attention.indexer_select(own["indexer"], x, c_q, cos, sin, ci["pool"], ci["state_a"],
                                                       ci["state_z"], p0, compress_freqs, cfg)[0]
                    overlap = attention.selection_overlap(own_ids, ids)
                if not cfg.index_cache_skip_compressor:  # keep this layer's indexer keys current
                    ci = take_layer(caches["indexer"], index_local)
                    keys, n_keys, isa, isz = attention.compress_chunk(
                        own["indexer"]["compressor"], x, ci["state_a"], ci["state_z"], p0, CSA, compress_freqs, cfg)
                    out["indexer"] = {"entries": keys, "n_new": n_keys, "state_a": isa, "state_z": isz}
            else:
                ci = take_layer(caches["indexer"], index_local)
                ids, keys, n_keys, isa, isz = attention.indexer_select(
                    own["indexer"], x, c_q, cos, sin, ci["pool"], ci["state_a"], ci["state_z"], p0,
                    compress_freqs, cfg)
                out["indexer"] = {"entries": keys, "n_new": n_keys, "state_a": isa, "state_z": isz}
            first = p0 // CSA
            if T == 1:  # decode: read only the selected rows of the pool
                rows = jnp.where((ids < first)[..., None],
                                 jnp.take_along_axis(c["pool"][:, None], jnp.clip(ids, 0)[..., None], axis=2),
                                 jnp.take_along_axis(entries[:, None], jnp.clip(ids - first, 0)[..., None], axis=2))
                comp_rows = rows[:, 0]
                comp_idx = jnp.where(ids >= 0, jnp.arange(ids.shape[-1], dtype=jnp.int32), -1)
            else:
                comp_rows, comp_idx = attention.in_entry_order(c["pool"], entries, first), ids
            o = attention.attend(q, c["ring"], kv, comp_rows, comp_idx, sink, p0, cfg)
            return o, ids, payloads(out), overlap
        return branch

    def hca_branch(q, kv, x, c_q, cos, sin, local, index_local, sink, caches, last_ids):
        own, c = take_layer(params["hca"], local), take_layer(caches["hca"], local)
        entries, n_new, sa, sz = attention.compress_chunk(
            own["compressor"], x, caches["hca"]["state_a"], caches["hca"]["state_z"], p0, HCA, compress_freqs, cfg,
            layer=local)
        P = c["pool"].shape[1]
        ids = jnp.arange(P, dtype=jnp.int32)
        ids = jnp.where(ids[None, :] < attention.visible_entries(p0, T, HCA)[:, None], ids[None, :], -1)
        comp_idx = jnp.broadcast_to(ids, (B, T, P))
        comp_rows = attention.in_entry_order(c["pool"], entries, p0 // HCA)
        o = attention.attend(q, c["ring"], kv, comp_rows, comp_idx, sink, p0, cfg)
        return o, last_ids, payloads({"hca": {"ring_rows": kv[:, T - n_keep:], "entries": entries, "n_new": n_new,
                                              "state_a": sa, "state_z": sz}}), jnp.float32(jnp.nan)

    branch_of = {"window": window_branch, "csa": csa(False), "csa_reuse": csa(True), "hca": hca_branch}
    branches = [branch_of[b] for b in sched.branches]
    ring_slots = (p0 + T - n_keep + jnp.arange(n_keep, dtype=jnp.int32)) % W
    ratio_of = {"window": None, "csa": CSA, "indexer": CSA, "hca": HCA}
    # Which branches write each group (the others send zeros to an out-of-range layer).
    writers = {"window": ("window",), "csa": ("csa", "csa_reuse"), "hca": ("hca",),
               "indexer": ("csa",) if cfg.index_cache_skip_compressor else ("csa", "csa_reuse")}

    def store(group: str, group_cache: dict, payload: dict, target, ratio) -> dict:
        """Writes a group's payload into layer `target` of its stacks (out of range: dropped)."""
        out = dict(group_cache)
        inside = target < next(iter(group_cache.values())).shape[0]  # this group has the layer
        if "ring" in group_cache:
            if n_keep == 1:
                out["ring"] = _put_row(group_cache["ring"], payload["ring_rows"], target, ring_slots[0], inside)
            else:
                out["ring"] = group_cache["ring"].at[target, :, ring_slots].set(
                    jnp.swapaxes(payload["ring_rows"], 0, 1), mode="drop")
        for k in group_cache:
            if k.startswith("state_") and state_row(group):
                out[k] = _put_row(group_cache[k], payload[k], target, p0 % ratio, inside)
            elif k.startswith("state_"):
                out[k] = group_cache[k].at[target].set(payload[k], mode="drop")
        if ratio is not None:
            pool, first = group_cache["pool"], p0 // ratio
            if payload["entries"].shape[1] == 1:
                out["pool"] = _put_row(pool, payload["entries"], target, first,
                                       inside & (payload["n_new"] > 0) & (first < pool.shape[2]))
            else:
                i = jnp.arange(payload["entries"].shape[1], dtype=jnp.int32)
                rows = jnp.where(i < payload["n_new"], first + i, pool.shape[2])
                out["pool"] = pool.at[target, :, rows].set(jnp.swapaxes(payload["entries"], 0, 1), mode="drop")
        return out

    def body(carry, xs):
        h, caches, last_ids = carry
        i, branch, local, index_local, compressed_rope, is_hash, route_local = xs
        layer = take_layer(params["layers"], i)
        cos, sin = rope_tables[compressed_rope]
        hc_args = dict(hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

        u, post, comb = hc_pre(h, **layer["hc_attn"], **hc_args)
        x = rms_norm(u, layer["attn_norm"], cfg.rms_norm_eps)
        a = layer["attn"]
        q, c_q = attention.query(a, x, cos, sin, cfg)
        kv = attention.key_value(a, x, cos, sin, cfg)
        # Branches only read the caches and return the rows to store; the writes come after the
        # switch, unconditionally, into every group's stacks: at the layer's own index when its
        # branch writes that group, else at an out-of-range index (dropped).
        o, last_ids, outs, overlap = jax.lax.switch(branch, branches, q, kv, x, c_q, cos, sin, local, index_local, a["sink"],
                                           caches, last_ids)
        new = {}
        for group, payload in zip(groups, outs):
            writes = jnp.isin(branch, jnp.asarray([i for i, b in enumerate(sched.branches) if b in writers[group]]))
            index = index_local if group == "indexer" else local
            target = jnp.where(writes, index, caches[group][next(iter(caches[group]))].shape[0])
            new[group] = store(group, caches[group], payload, target, ratio_of[group])
        h = hc_post(attention.output(a, o, cos, sin, cfg), h, post, comb)

        u, post, comb = hc_pre(h, **layer["hc_ffn"], **hc_args)
        x = rms_norm(u, layer["ffn_norm"], cfg.rms_norm_eps)
        h = hc_post(_moe(params, layer, i, x, input_ids, is_hash, route_local, cfg), h, post, comb)
        return (h, new, last_ids), overlap

    x = params["embed"][input_ids]
    h = jnp.broadcast_to(x[:, :, None, :], (B, T, cfg.hc_mult, cfg.hidden_size))
    xs = (jnp.arange(cfg.num_layers, dtype=jnp.int32), jnp.asarray(sched.branch), jnp.asarray(sched.kind_local),
          jnp.asarray(sched.index_local), jnp.asarray(sched.compressed_rope), jnp.asarray(sched.is_hash),
          jnp.asarray(sched.route_local))
    stacks = {k: v for k, v in cache.items() if k != "pos"}
    k_index = min(cfg.index_topk, cache["csa"]["pool"].shape[2]) if "csa" in cache else 1
    last_ids = jnp.full((B, T, k_index), -1, jnp.int32)  # no top-k computed yet in this call
    (h, stacks, _), overlaps = jax.lax.scan(body, (h, stacks, last_ids), xs)
    if last_only:
        h = h[:, -1:]
    y = hc_head(h, params["hc_head"]["fn"], params["hc_head"]["base"], params["hc_head"]["scale"],
                hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    y = rms_norm(y, params["norm"], cfg.rms_norm_eps)
    logits = dense(y.astype(jnp.float32), params["head"].astype(jnp.float32))
    if measure_reuse:
        return logits, {"pos": p0 + T, **stacks}, overlaps
    return logits, {"pos": p0 + T, **stacks}


def forward(params: dict, input_ids: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """Full-sequence forward from position 0 with a fresh cache: int `[B, S]` -> fp32 logits
    `[B, S, V]`."""
    B, S = input_ids.shape
    cache = init_cache(cfg, B, S, params["embed"].dtype)
    return step(params, cache, input_ids, cfg)[0]


RUNTIME_OPTIONS = ("attention_impl", "use_index_cache", "index_topk_freq", "index_topk_pattern",
                   "index_cache_skip_compressor")


def with_options(cfg: ModelConfig, **options) -> ModelConfig:
    """cfg with run-time options replaced (None leaves one as it is); an unknown name is an error."""
    unknown = sorted(set(options) - set(RUNTIME_OPTIONS))
    if unknown:
        raise TypeError(f"unknown model options {unknown}; allowed: {list(RUNTIME_OPTIONS)}")
    changes = {k: v for k, v in options.items() if v is not None}
    return cfg.replace(**changes) if changes else cfg


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
