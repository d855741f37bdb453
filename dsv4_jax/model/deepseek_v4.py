"""The whole model: embedding, the layer stack, the hyper-connection head and the LM head.

The stack is one `lax.scan` over layers (a while loop over the same body where a prefill chunk
runs only the first layers: `run_layers`'s depth). The body dispatches with `lax.switch` on the
layer's kind (window only, ratio 4, ratio 4 reusing the previous top-k under IndexCache, ratio 128);
each kind's own weights and caches live in their own stacks (`params["csa"]`, `cache["hca"]`,
...) and a layer reaches them through its kind-local index, carried in the loop's xs, as it
reaches the weights every layer has (`params["layers"]`) through its layer index (on CPU
`generate` keeps the large ones as one buffer per layer: dsv4_jax/model/layer_weights.py). The last
computed indexer top-k travels in the loop's carry.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import kv_record
from pallas_kernels.numerics import rms_norm
from . import attention, sharding
from .cache import indexer_state_layers, init_cache, pool_entries, pool_view, pool_write
from .blocks import Block, CompressedLayers, DecoderLayers, HyperConnection, MTPBlock
from .config import ModelConfig
from .layer_kinds import BY_RATIO, CSA, HCA, KINDS, WINDOW
from .hyper_connection import hc_head, hc_post, hc_pre
from .index_cache import index_cache_schedule
from .indexer import distillation_kl
from .layer_weights import take_layer
from .linear import dense
from .moe import learned_choice, route, routed_experts, routed_experts_on_mesh, router_scores, shared_expert
from .rope import cos_sin, layer_inv_freqs


# The switch's branches, in this order when present: one per layer kind, and a ratio-4 layer that
# reuses another's top-k (IndexCache).
BRANCHES = ("window", "csa", "csa_reuse", "hca")


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
        names = [BY_RATIO[r].name + ("_reuse" if i in reusing else "") for i, r in enumerate(ratios)]
        branches = tuple(b for b in BRANCHES if b in names)
        local = np.zeros_like(ratios)
        for kind in KINDS:
            local[ratios == kind.ratio] = np.arange(int(np.sum(ratios == kind.ratio)))
        with_index = indexer_state_layers(cfg)
        index_local = np.array([with_index.index(i) if i in with_index else len(with_index)
                                for i in range(cfg.num_layers)], np.int32)
        is_hash = np.array(cfg.hash_layers, dtype=bool)
        route_local = np.where(is_hash, np.cumsum(is_hash) - 1, np.cumsum(~is_hash) - 1)
        return cls(branches, np.array([branches.index(n) for n in names], np.int32), local.astype(np.int32),
                   index_local, (ratios != WINDOW).astype(np.int32), is_hash, route_local.astype(np.int32))


def _moe(params: dict, layer: dict, x: jnp.ndarray, ids: jnp.ndarray, is_hash, route_local,
         cfg: ModelConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """MoE of a layer (its weights: `layer`, from `take_layer`) on x `[B, S, D]` (already ffn-normed);
    ids `[B, S]` for hash routing. Returns (its output `[B, S, D]`, the chosen experts `[B S, k]`)."""
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
    routed_weights = f["w1"], f["w2"], f["w3"]  # read in place in the stacks (see `take_layer`)
    if sharding.active(cfg) is not None:  # expert parallel: tokens exchanged between devices
        routed = routed_experts_on_mesh(xt, experts, weights, *routed_weights, cfg.swiglu_limit, cfg)
    else:
        routed = routed_experts(xt, experts, weights, *routed_weights, cfg.swiglu_limit,
                                fp8_activations=cfg.fp8_activations, impl=cfg.attention_impl)
    shared = shared_expert(xt, f["shared_w1"], f["shared_w2"], f["shared_w3"], cfg.swiglu_limit, cfg)
    return (routed + shared.astype(jnp.float32)).astype(x.dtype).reshape(B, S, D), experts


class _Chunk(NamedTuple):
    """What every layer of one `step` shares about where the chunk sits in each row."""

    p0: jnp.ndarray  # int32 [B]: each row's first position
    n_valid: jnp.ndarray  # int32 [B]: each row's real tokens (the rest of its T are padding)
    rope: jnp.ndarray  # fp32 [2 (window-only, compressed), 2 (cos, sin), B, T, rope/2]
    compress_freqs: jnp.ndarray  # [rope/2]
    blocks: jnp.ndarray | None  # int32 [B, nb]: each row's block table (cache.py); None without pools
    shared: jnp.ndarray  # int32 [B]: positions before it are in shared blocks (cache.py), 0 without pools
    folded: jnp.ndarray  # int32 [B]: the compressors' folded state rows end here (attention.compress_chunk)
    groups: int  # row / block groups of the pools' reads and writes (cache._by_group): 1 unless in place on a mesh


class _LayerInput(NamedTuple):
    """One layer's inputs to its attention branch. The queries cross the layer switch as token
    rows `[B * T, H * Dh]`, as the branch's output does (`_rows_out`): a switch's operands and
    results take the default layout, which on TPU tiles `[B, T, H, Dh]` by heads and dims, while
    the projections on either side (and the TPU attention kernel) write and read tiles of tokens
    by `H * Dh`: a re-layout of the whole queries and output each way."""

    query_rows: jnp.ndarray  # [B * T, H * Dh], before the per-head norm and unrotated (`attention.query`)
    kv: jnp.ndarray  # [B, T, Dh]
    x: jnp.ndarray  # [B, T, D] the normed attention input
    c_q: jnp.ndarray  # [B, T, Q] the query latent
    cos: jnp.ndarray  # [B, T, rope/2] at the layer's rope
    sin: jnp.ndarray
    local: jnp.ndarray  # index into the layer's kind stacks
    index_local: jnp.ndarray  # index into the indexer-state stacks
    sink: jnp.ndarray  # [H]

    @property
    def rope(self) -> tuple[jnp.ndarray, jnp.ndarray]:
        return self.cos, self.sin

    @property
    def q(self) -> jnp.ndarray:
        """The queries `[B, T, H, Dh]`."""
        return self.query_rows.reshape(*self.x.shape[:2], self.sink.shape[0], -1)


def _rows_out(branch):
    """A branch of the layer switch, its output `[B, T, H, Dh]` given as token rows `[B * T, H *
    Dh]` (`_LayerInput`)."""
    def run(lay: _LayerInput, caches: dict, last_ids):
        o, *rest = branch(lay, caches, last_ids)
        return (o.reshape(lay.query_rows.shape), *rest)

    return run


@dataclasses.dataclass(frozen=True)
class _Step:
    """The fixed context of one `step` call, bound into the switch branches."""

    params: dict
    cfg: ModelConfig
    chunk: _Chunk
    cache_shapes: dict  # group -> {name: ShapeDtypeStruct}, the stacks this step updates
    measure_reuse: bool
    indexer_kl: bool
    expert_load: bool

    def payloads(self, own: dict) -> tuple:
        """Every cache group's payload, in `cache_shapes` order: the branch's own, zeros (nothing
        to store) for the groups it does not write."""
        return tuple(own.get(g) or self.nothing(g) for g in self.cache_shapes)

    def nothing(self, group: str) -> dict:
        """The payload of a group a branch does not write: zeros, no entry to store."""
        B, T = self.chunk.rope.shape[2:4]
        out = {}
        for k, v in self.cache_shapes[group].items():
            if k.startswith("state_"):
                m = attention.state_writes_rows(_RATIO_OF[group], T, v.shape[2])
                out[k] = jnp.zeros((B, m, v.shape[-1]), v.dtype)
                out["state_slots"] = jnp.full((B, m), v.shape[2], jnp.int32)  # out of range: not written
            elif k == "ring":
                out["kv"] = jnp.zeros((B, T, v.shape[-1]), v.dtype)
            elif k == "pool":
                ratio = _RATIO_OF[group]
                out["entries"] = jnp.zeros((B, (T + ratio - 1) // ratio, v.shape[-1]), v.dtype)
                out["n_new"] = jnp.zeros((B,), jnp.int32)
        return out


# A layer's (reuse overlap, attention JS, dropped mass, indexer KL), NaN where it has none
# (`step`'s measure_reuse, indexer_kl).
_NO_AUX = np.full((4,), np.nan, np.float32)


def _window_branch(ctx: _Step, lay: _LayerInput, caches: dict, last_ids):
    """A window-only layer: its ring and the chunk."""
    ring = take_layer(caches["window"]["ring"], lay.local)
    kv = _stored(lay.kv, ring, ctx.cfg.rope_head_dim)
    o = attention.attend(lay.q, lay.rope, ring, kv, None, None, lay.sink, ctx.chunk.p0, ctx.cfg)
    return o, last_ids, ctx.payloads({"window": {"kv": kv}}), _NO_AUX


def _kv_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(values, RoPE dims among them) of a K=V row or compressed entry, as its FP8 record holds them."""
    return cfg.head_dim, cfg.rope_head_dim


def _key_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(values, RoPE dims) of an indexer key's FP8 record: the Hadamard rotation mixes every dim,
    so none is kept apart."""
    return cfg.index_head_dim, 0


def _stored(entries: jnp.ndarray, pool: jnp.ndarray, rope: int) -> jnp.ndarray:
    """Entries, keys or K=V rows `[B, n, d]` in the form `pool` (a pool or a ring) stores: FP8
    records (words `[B, n, R / 4]`) or themselves."""
    if pool.dtype != jnp.uint32:
        return entries
    return kv_record.to_words(kv_record.encode(entries, rope))


def _pinned(entries: jnp.ndarray, pools: jnp.ndarray, layer, ch: _Chunk, ratio: int) -> jnp.ndarray:
    """A chunk's new entries as layer `layer` of pools `[n, NB, E, .]` stores them, `[B, n, .]` (row b's i-th is entry
    p0[b] // ratio + i), those before the row's shared position taken from its shared blocks instead: a row
    restarted inside a cached prefix computes them from don't-cares (cache.py), and its later
    positions must read the entries the prefix really has; in a prefill chunk, or one token a
    step (the engine's deterministic mode feeds prompts through decode)."""
    if entries.shape[1] == 0:
        return entries
    ids = ch.p0[:, None] // ratio + jnp.arange(entries.shape[1], dtype=jnp.int32)
    held = jnp.clip(ids, 0, ch.blocks.shape[1] * pools.shape[2] - 1)
    return jnp.where((ids < ch.shared[:, None] // ratio)[..., None],
                     pool_entries(pools, layer, ch.blocks, held, ch.groups), entries)


def _state_payload(w: attention.StateWrites) -> dict:
    """A compressor's state writes as a cache group's payload (stored by `_store`)."""
    return {"state_a": w.a, "state_z": w.z, "state_slots": w.slots}


def _csa_branch(ctx: _Step, lay: _LayerInput, caches: dict, last_ids, reuse: bool):
    """A ratio-4 layer: window plus the indexer's top-k compressed entries; with `reuse`
    (IndexCache) the last computing layer's entry ids, with this layer's own rows."""
    cfg, ch = ctx.cfg, ctx.chunk
    T = lay.q.shape[1]
    own, c = take_layer(ctx.params["csa"], lay.local), take_layer(caches["csa"], lay.local)
    entries, n_new, state = attention.compress_chunk(
        own["compressor"], lay.x, c["state_a"], c["state_z"], ch.p0, CSA, ch.compress_freqs, cfg, n_valid=ch.n_valid,
        folded=ch.folded)
    rope = cfg.rope_head_dim
    pools = caches["csa"]["pool"]  # read as the stack (cache.pool_view)
    entries = _pinned(_stored(entries, pools, rope), pools, lay.local, ch, CSA)
    ring, kv = c["ring"], _stored(lay.kv, c["ring"], rope)
    out = {"csa": {"kv": kv, "entries": entries, "n_new": n_new, **_state_payload(state)}}
    measures, kl = _NO_AUX[:3], jnp.float32(jnp.nan)
    # The indexer's inputs are held constant: choosing is not differentiable, and its training loss
    # (`indexer.distillation_kl`) must teach the indexer alone, not the main model (DeepSeek-V3.2).
    x, c_q = jax.lax.stop_gradient(lay.x), jax.lax.stop_gradient(lay.c_q)

    def indexer_keys():
        """This layer's indexer keys of the chunk, its compressor's payload (the keys as the pool
        stores them) and its key pool."""
        ci = take_layer(caches["indexer"], lay.index_local)
        keys, n_keys, state = attention.compress_chunk(
            own["indexer"]["compressor"], x, ci["state_a"], ci["state_z"], ch.p0, CSA, ch.compress_freqs, cfg,
            n_valid=ch.n_valid, folded=ch.folded)
        key_pools = caches["indexer"]["pool"]
        stored = _pinned(_stored(keys, key_pools, 0), key_pools, lay.index_local, ch, CSA)
        payload = {"entries": stored, "n_new": n_keys, **_state_payload(state)}
        return kv_record.read(stored, *_key_dims(cfg), keys.dtype), payload

    def own_choice(keys):
        """This layer's indexer scores of every entry `[B, T, N]` and its top-k ids `[B, T, K]`."""
        pool = pool_view(caches["indexer"]["pool"], lay.index_local, ch.blocks, ch.groups)  # records: decoded as scored
        scores = attention.indexer_logits(own["indexer"], x, c_q, lay.cos, lay.sin, pool, keys, ch.p0, cfg)
        return scores, attention.indexer_select(scores, ch.p0, pool.shape[1], cfg)

    first = ch.p0 // CSA
    ordered = None  # every entry in entry order, as stored `[B, P + n, .]`: a prefill chunk's rows, the reuse measures'
    if T > 1 or (reuse and ctx.measure_reuse):
        ordered = attention.in_entry_order(pool_view(pools, lay.local, ch.blocks, ch.groups), entries, first)
    dtype = lay.q.dtype
    if reuse:  # IndexCache: the previous computing layer's entries, this layer's rows
        ids = last_ids
        if ctx.measure_reuse or not cfg.index_cache_skip_compressor:
            keys, payload = indexer_keys()
            if ctx.measure_reuse:
                values = [kv_record.read(x, *_kv_dims(cfg), dtype) for x in (ring, kv, ordered)]
                q = attention.rotated_queries(lay.q, lay.rope, cfg)
                measures = attention.reuse_measures(q, *values, own_choice(keys)[1], ids, lay.sink, ch.p0, cfg)
            if not cfg.index_cache_skip_compressor:  # keep this layer's indexer keys current
                out["indexer"] = payload
    else:
        keys, out["indexer"] = indexer_keys()
        scores, ids = own_choice(keys)
    if T == 1:  # decode: read only the selected rows of the pool
        old = (ids < first[:, None, None])[..., None]
        rows = jnp.where(old, pool_entries(pools, lay.local, ch.blocks, jnp.clip(ids, 0), ch.groups),
                         jnp.take_along_axis(entries[:, None], jnp.clip(ids - first[:, None, None], 0)[..., None],
                                             axis=2))
        comp_rows = rows[:, 0]
        comp_idx = jnp.where(ids >= 0, jnp.arange(ids.shape[-1], dtype=jnp.int32), -1)
    else:
        comp_rows, comp_idx = ordered, ids
        if ctx.indexer_kl and not reuse:
            kl = distillation_kl(attention.rotated_queries(lay.q, lay.rope, cfg),
                                 kv_record.read(comp_rows, *_kv_dims(cfg), dtype), scores, ids, cfg.head_dim ** -0.5)
    o = attention.attend(lay.q, lay.rope, ring, kv, comp_rows, comp_idx, lay.sink, ch.p0, cfg)
    return o, ids, ctx.payloads(out), jnp.concatenate([jnp.asarray(measures, jnp.float32), kl[None]])


def _hca_branch(ctx: _Step, lay: _LayerInput, caches: dict, last_ids):
    """A ratio-128 layer: window plus every visible compressed entry."""
    cfg, ch = ctx.cfg, ctx.chunk
    B, T = lay.q.shape[:2]
    own, ring = take_layer(ctx.params["hca"], lay.local), take_layer(caches["hca"]["ring"], lay.local)
    entries, n_new, state = attention.compress_chunk(
        own["compressor"], lay.x, caches["hca"]["state_a"], caches["hca"]["state_z"], ch.p0, HCA, ch.compress_freqs,
        cfg, layer=lay.local, n_valid=ch.n_valid, folded=ch.folded)
    rope = cfg.rope_head_dim
    pools = caches["hca"]["pool"]  # read as the stack (cache.pool_view)
    entries = _pinned(_stored(entries, pools, rope), pools, lay.local, ch, HCA)
    pool = pool_view(pools, lay.local, ch.blocks, ch.groups)
    ids = jnp.arange(pool.shape[1], dtype=jnp.int32)
    comp_idx = jnp.where(ids < attention.visible_entries(ch.p0, T, HCA)[..., None], ids, -1)  # [B, T, P]
    comp_rows = attention.in_entry_order(pool, entries, ch.p0 // HCA)
    kv = _stored(lay.kv, ring, rope)
    o = attention.attend(lay.q, lay.rope, ring, kv, comp_rows, comp_idx, lay.sink, ch.p0, cfg)
    payload = {"kv": kv, "entries": entries, "n_new": n_new, **_state_payload(state)}
    return o, last_ids, ctx.payloads({"hca": payload}), _NO_AUX


_BRANCH_FNS = {"window": _window_branch, "csa": partial(_csa_branch, reuse=False),
               "csa_reuse": partial(_csa_branch, reuse=True), "hca": _hca_branch}
_RATIO_OF = {**{k.name: k.ratio or None for k in KINDS}, "indexer": CSA}  # a group's entries


def _writers(cfg: ModelConfig) -> dict:
    """The branches that write each cache group (the others store nothing there)."""
    return {"window": ("window",), "csa": ("csa", "csa_reuse"), "hca": ("hca",),
            "indexer": ("csa",) if cfg.index_cache_skip_compressor else ("csa", "csa_reuse")}


def _store(group: str, stacks: dict, payload: dict, target, chunk: _Chunk) -> dict:
    """Writes a group's payload into layer `target` of its stacks `[n, B, ...]` (out of range:
    dropped), each row at its own positions: the chunk's K=V rows into their ring
    (`attention.ring_writes`), the compressor's state rows into their slots, the entries the row completed at their ids, in the
    blocks its table (chunk.blocks) names, except those before the row's shared position (the
    shared blocks hold them)."""
    out = dict(stacks)
    B = chunk.p0.shape[0]
    T = chunk.rope.shape[3]
    b = jnp.arange(B)[:, None]
    if "ring" in stacks:
        which, slots = attention.ring_writes(chunk.p0, chunk.n_valid, T, stacks["ring"].shape[2])
        values = jnp.take_along_axis(payload["kv"], which[..., None], axis=1)
        out["ring"] = stacks["ring"].at[target, b, slots].set(values.astype(stacks["ring"].dtype), mode="drop")
    for k in ("state_a", "state_z"):
        if k in stacks:
            out[k] = stacks[k].at[target, b, payload["state_slots"]].set(payload[k], mode="drop")
    ratio = _RATIO_OF[group]
    if ratio is not None:
        i = jnp.arange(payload["entries"].shape[1], dtype=jnp.int32)[None, :]
        at = chunk.p0[:, None] // ratio + i
        at = jnp.where((i < payload["n_new"][:, None]) & (at >= chunk.shared[:, None] // ratio), at, -1)
        out["pool"] = pool_write(stacks["pool"], target, chunk.blocks, at, payload["entries"], chunk.groups)
    return out


def _layer(ctx: _Step, sched: LayerSchedule, input_ids, carry, xs):
    """One layer of the loop: attention (its kind's branch, then the cache writes), then the MoE."""
    params, cfg = ctx.params, ctx.cfg
    h, caches, last_ids = carry
    i, branch, local, index_local, compressed_rope, is_hash, route_local = xs
    layer = take_layer(params["layers"], i)
    cos, sin = ctx.chunk.rope[compressed_rope]
    hc_args = dict(hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, cfg=cfg)

    u, post, comb = hc_pre(h, **layer["hc_attn"], **hc_args)
    x = rms_norm(u, layer["attn_norm"], cfg.rms_norm_eps)
    a = layer["attn"]
    q, c_q = attention.query(a, x, cfg)
    kv = attention.key_value(a, x, cos, sin, cfg)
    lay = _LayerInput(q.reshape(q.shape[0] * q.shape[1], -1), kv, x, c_q, cos, sin, local, index_local, a["sink"])
    # Branches only read the caches and return the rows to store; the writes come after the
    # switch, unconditionally, into every group's stacks: at the layer's own index when its
    # branch writes that group, else at an out-of-range index (dropped).
    branches = [_rows_out(partial(_BRANCH_FNS[b], ctx)) for b in sched.branches]
    o, last_ids, outs, aux = jax.lax.switch(branch, branches, lay, caches, last_ids)
    writers = _writers(cfg)
    new = {}
    for group, payload in zip(ctx.cache_shapes, outs):
        writes = jnp.isin(branch, jnp.asarray([j for j, b in enumerate(sched.branches) if b in writers[group]]))
        n_layers = next(iter(caches[group].values())).shape[0]
        target = jnp.where(writes, index_local if group == "indexer" else local, n_layers)
        new[group] = _store(group, caches[group], payload, target, ctx.chunk)
    h = hc_post(attention.output(a, o.reshape(q.shape), lay.rope, cfg), h, post, comb, cfg)

    u, post, comb = hc_pre(h, **layer["hc_ffn"], **hc_args)
    x = rms_norm(u, layer["ffn_norm"], cfg.rms_norm_eps)
    f, experts = _moe(params, layer, x, input_ids, is_hash, route_local, cfg)
    h = hc_post(f, h, post, comb, cfg)
    load = jnp.zeros((0,), jnp.int32)
    if ctx.expert_load:  # the real tokens' choices per expert
        real = jnp.arange(x.shape[1])[None, :] < ctx.chunk.n_valid[:, None]  # [B, S]
        load = jnp.zeros((cfg.n_routed_experts,), jnp.int32).at[experts.reshape(-1)].add(
            jnp.repeat(real.reshape(-1), experts.shape[1]).astype(jnp.int32))
    return (h, new, last_ids), (aux, load)


def _rows_valid(n_valid, B: int, T: int) -> jnp.ndarray:
    """n_valid as int32 `[B]` (None: every row's T tokens are real)."""
    return jnp.full((B,), T, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)


def _chunk(cache: dict, B: int, T: int, n_valid, cfg: ModelConfig, rows_in_place: bool) -> _Chunk:
    p0 = cache["pos"]
    n_valid = _rows_valid(n_valid, B, T)
    window_freqs, compress_freqs = (jnp.asarray(f) for f in layer_inv_freqs(cfg))
    positions = p0[:, None] + jnp.arange(T, dtype=jnp.int32)
    rope = jnp.stack([jnp.stack(cos_sin(positions, window_freqs)), jnp.stack(cos_sin(positions, compress_freqs))])
    mesh = sharding.active(cfg)
    groups = cfg.layout.shards(sharding.BATCH, mesh) if rows_in_place and mesh is not None else 1
    shared = cache.get("shared", jnp.zeros((B,), jnp.int32))
    return _Chunk(p0, n_valid, rope, compress_freqs, cache.get("blocks"), shared, cache.get("folded", p0),
                  groups if B % groups == 0 else 1)


def run_layers(params: dict, cache: dict, h: jnp.ndarray, input_ids: jnp.ndarray, cfg: ModelConfig,
               n_valid: jnp.ndarray | None = None, measure_reuse: bool = False, rows_in_place: bool = True,
               indexer_kl: bool = False, expert_load: bool = False, depth: jnp.ndarray | None = None):
    """Runs the layer stack of `params` (one loop over cfg's layers, module doc) on the hidden
    streams h `[B, T, hc, D]` of a chunk, row b at positions cache["pos"][b] .. (n_valid as in
    `step`; input_ids int `[B, T]` for hash routing). Returns (the streams after the last layer
    `[B, T, hc, D]`, the cache with the chunk added, per layer (reuse overlap, attention JS, dropped
    mass, indexer KL) `[L, 4]` as `step`'s measure_reuse and indexer_kl, and with expert_load each
    layer's choices per expert int32 `[L, E]` (else `[L, 0]`)). depth (int32 scalar, at run time;
    None: every layer): only the first depth layers run, the others neither read nor write their
    caches and pass the streams through (`cache.layers_to_run`: a row recomputing a cached prefix's
    span needs no more). The MTP block (dsv4_jax/model/mtp.py) runs its one layer through here too,
    as the stack of a one-layer model."""
    B, T = input_ids.shape
    sched = LayerSchedule.of(cfg)
    cache = sharding.constrain_cache(cfg, cache)
    stacks = {g: cache[g] for g in ("window", "csa", "indexer", "hca") if g in cache}
    chunk = _chunk(cache, B, T, n_valid, cfg, rows_in_place)
    ctx = _Step(params, cfg, chunk, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stacks),
                measure_reuse, indexer_kl, expert_load)
    xs = (jnp.arange(cfg.num_layers, dtype=jnp.int32), jnp.asarray(sched.branch), jnp.asarray(sched.kind_local),
          jnp.asarray(sched.index_local), jnp.asarray(sched.compressed_rope), jnp.asarray(sched.is_hash),
          jnp.asarray(sched.route_local))
    k_index = min(cfg.index_topk, cache["blocks"].shape[1] * cache["csa"]["pool"].shape[2]) if "csa" in cache else 1
    last_ids = jnp.full((B, T, k_index), -1, jnp.int32)  # no top-k computed yet in this call
    layer = partial(_layer, ctx, sched, input_ids)
    if depth is None:  # every layer: a scan (differentiable)
        (h, stacks, _), (aux, load) = jax.lax.scan(layer, (h, stacks, last_ids), xs)
    else:  # the first depth layers, a count known at run time: a while loop
        L = cfg.num_layers

        def first(i, carry):
            c, aux, load = carry
            c, (a, n) = layer(c, jax.tree.map(lambda x: x[i], xs))
            return c, aux.at[i].set(a), load.at[i].set(n)

        E = cfg.n_routed_experts if expert_load else 0
        (h, stacks, _), aux, load = jax.lax.fori_loop(
            0, jnp.minimum(depth, L), first,
            ((h, stacks, last_ids), jnp.broadcast_to(_NO_AUX, (L, 4)), jnp.zeros((L, E), jnp.int32)))
    moved = {"pos": chunk.p0 + chunk.n_valid}
    if "folded" in cache:
        lookahead = next(g["ring"].shape[2] for g in stacks.values() if "ring" in g) - cfg.sliding_window
        moved["folded"] = attention.fold_point(chunk.p0, chunk.n_valid, lookahead)
    return h, {**cache, **moved, **stacks}, aux, load


def lm_logits(h: jnp.ndarray, hc_head_params: dict, norm: jnp.ndarray, head: jnp.ndarray,
              cfg: ModelConfig) -> jnp.ndarray:
    """The head on hidden streams h `[B, T, hc, D]`: the hyper-connection head (`hc_head_params`
    {fn, base, scale}), RMSNorm with `norm`, then the fp32 projection on `head` `[V, D]` -> fp32
    `[B, T, V]`. The MTP block applies it with its own hc head and norm and the shared head."""
    y = hc_head(h, hc_head_params["fn"], hc_head_params["base"], hc_head_params["scale"],
                hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, cfg=cfg)
    y = rms_norm(y, norm, cfg.rms_norm_eps)
    return dense(y.astype(jnp.float32), head.astype(jnp.float32))


class ReuseMeasures(NamedTuple):
    """Per layer `[L]`, what IndexCache's reuse changes in it (`attention.reuse_measures`; NaN for
    layers that do not reuse)."""

    overlap: jnp.ndarray  # the fraction of its own top-k that the reused ids contain
    attention_js: jnp.ndarray  # Jensen-Shannon divergence of its attention, own ids against reused (nats)
    dropped_mass: jnp.ndarray  # its own-id attention's mass on entries the reused ids lack


class StepOutput(NamedTuple):
    """What `step` gives for a chunk."""

    logits: jnp.ndarray  # fp32 [B, T, V], or [B, 1, V] at each row's last real token with last_only
    cache: dict  # the cache with the chunk added
    hidden: jnp.ndarray | None = None  # with return_hidden: the final streams [B, T, hc, D] before the hc head
    reuse: ReuseMeasures | None = None  # with measure_reuse
    indexer_kl: jnp.ndarray | None = None  # with indexer_kl: [L], per layer (NaN: no indexer of its own)
    expert_load: jnp.ndarray | None = None  # with expert_load: int32 [L, E], each layer's choices per expert


def step(params: dict, cache: dict, input_ids: jnp.ndarray, cfg: ModelConfig, last_only: bool = False,
         measure_reuse: bool = False, n_valid: jnp.ndarray | None = None, return_hidden: bool = False,
         rows_in_place: bool = True, indexer_kl: bool = False, expert_load: bool = False,
         depth: jnp.ndarray | None = None) -> StepOutput:
    """Runs a chunk of T tokens per row through the model, row b at positions cache["pos"][b] ..

    input_ids int `[B, T]`. n_valid int32 `[B]` (default T): row b's real tokens, the first
    n_valid[b] of its chunk; the rest are padding, neither stored nor advancing the row (0: the
    row holds its state). Rows advance independently: each has its own window-ring slots,
    compression-block phase, pool length, RoPE positions and causal limits. Returns a StepOutput:
    fp32 logits `[B, T, V]`, or `[B, 1, V]` at each row's last real token with last_only, and the
    cache with the chunk added. Prefill (any T, chunks of any size) and decode (T = 1) are the same
    computation; the caller keeps pos + n_valid <= max_len. With measure_reuse, IndexCache's
    reusing layers also compute their own top-k (not used) and `reuse` (ReuseMeasures) says per
    layer how the reused selection differs from it: overlap, and what it changes in the layer's
    attention (NaN for layers that do not reuse). With return_hidden (static, like last_only) `hidden` holds the final
    hidden streams `[B, T, hc, D]` before the hyper-connection head at every position of the
    chunk (also with last_only): what the MTP block (dsv4_jax/model/mtp.py) takes as `hidden`.
    rows_in_place (static): the rows are the cache's own, in order, so on a mesh each device's rows
    hold their blocks on that device and the pools are read and written device by device; False
    for a sub-batch of rows taken out of a larger cache (cache.take_rows), whose rows sit elsewhere.
    With indexer_kl (static; chunks of T > 1), `indexer_kl` `[L]` gives each ratio-4 layer that
    chooses its own entries the indexer's training loss on the chunk (`indexer.distillation_kl`).
    With expert_load (static), `expert_load` `[L, E]` counts, per layer, the (token, expert)
    choices of the real tokens: what auxiliary-loss-free balancing steers by (training/trainer.py).
    depth: run only the first depth layers (`run_layers`).
    """
    B, T = input_ids.shape
    x = params["embed"][input_ids]
    h = sharding.constrain(cfg, jnp.broadcast_to(x[:, :, None, :], (B, T, cfg.hc_mult, cfg.hidden_size)),
                           (sharding.BATCH, None, None, None))
    hidden, new_cache, aux, load = run_layers(params, cache, h, input_ids, cfg, n_valid, measure_reuse,
                                              rows_in_place, indexer_kl, expert_load, depth)
    h = hidden
    if last_only:
        last = jnp.clip(_rows_valid(n_valid, B, T) - 1, 0)
        h = jnp.take_along_axis(h, last[:, None, None, None], axis=1)
    logits = lm_logits(h, params["hc_head"], params["norm"], params["head"], cfg)
    return StepOutput(logits, new_cache, hidden if return_hidden else None,
                      ReuseMeasures(aux[:, 0], aux[:, 1], aux[:, 2]) if measure_reuse else None,
                      aux[:, 3] if indexer_kl else None, load if expert_load else None)


def forward(params: dict, input_ids: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """Full-sequence forward from position 0 with a fresh cache: int `[B, S]` -> fp32 logits
    `[B, S, V]`."""
    B, S = input_ids.shape
    cache = init_cache(cfg, B, S, params["embed"].dtype)
    return step(params, cache, input_ids, cfg).logits


RUNTIME_OPTIONS = ("attention_impl", "expert_exchange", "fp8_activations", "use_index_cache", "index_topk_freq", "index_topk_pattern",
                   "index_cache_skip_compressor")


def with_options(cfg: ModelConfig, **options) -> ModelConfig:
    """cfg with run-time options replaced (None leaves one as it is); an unknown name is an error."""
    unknown = sorted(set(options) - set(RUNTIME_OPTIONS))
    if unknown:
        raise TypeError(f"unknown model options {unknown}; allowed: {list(RUNTIME_OPTIONS)}")
    changes = {k: v for k, v in options.items() if v is not None}
    return cfg.replace(**changes) if changes else cfg


class DeepseekV4(Block):
    """A DeepSeek-V4 model as a Flax NNX module: `logits = model(input_ids)` for int32 `[B, S]` ->
    fp32 `[B, S, V]`. Its blocks (dsv4_jax/model/blocks.py) hold the weights under the names of the
    parameter tree, so `nnx.state(model)` is the converted checkpoint (`params/`, and `mtp/` for
    `model.mtp`), and
    `model.params` the tree the jitted programs take (`step`, dsv4_jax/runtime/decode.py), read
    once per call, not per step.

    On a device mesh (`load(..., mesh=)`), `mesh` is set, `config.layout` says where every array
    lives (dsv4_jax/model/sharding.py) and the jitted programs run under `jax.set_mesh(mesh)`. With
    `load(..., mtp=True)` (or `mtp=` a block's parameter tree), `mtp` holds the checkpoint's MTP
    block (speculative decoding)."""

    PARTS = {"hc_head": HyperConnection, "layers": DecoderLayers, "csa": CompressedLayers,
             "hca": CompressedLayers}

    def __init__(self, params: dict, config: ModelConfig, mesh: jax.sharding.Mesh | None = None,
                 mtp: dict | None = None):
        super().__init__(params)
        self.config = config
        self.mesh = mesh
        self.mtp = nnx.data(None if mtp is None else MTPBlock(mtp))  # a sub-module, also when set later

    @property
    def params(self) -> dict:
        """The main model's weights as the plain parameter tree (dsv4_jax/model/params.py), the MTP
        block's apart (`model.mtp.params`)."""
        tree = super().params
        tree.pop("mtp", None)
        return tree

    def __call__(self, input_ids) -> jnp.ndarray:
        ids = np.asarray(input_ids, np.int32)
        B = ids.shape[0]
        rows = self.batch_rows(B)
        if rows > B:  # every device of the batch axes gets whole sequences
            ids = np.concatenate([ids, np.zeros((rows - B,) + ids.shape[1:], np.int32)])
        with self.on_mesh():
            return _jit_forward(self.params, self.place_rows(ids), self.config)[:B]

    def on_mesh(self):
        """The context the model's programs run in: `jax.set_mesh(mesh)`, or nothing."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def batch_rows(self, B: int) -> int:
        """B rounded up to a multiple of the number of pieces the mesh splits sequences into."""
        n = 1 if self.mesh is None else self.config.layout.shards(sharding.BATCH, self.mesh)
        return -(-B // n) * n

    def new_cache(self, rows: int, max_len: int, cfg: ModelConfig | None = None, lookahead: int = 0, *,
                  block_size: int | None = None, num_blocks: int | None = None, kv_cache_dtype: str = "auto") -> dict:
        """An empty cache of `rows` sequences of up to max_len tokens on the model's devices (rows
        and pool blocks split over the mesh's batch axes). cfg: the config with this call's options
        (default the model's); lookahead, block_size, num_blocks, kv_cache_dtype: as
        `cache.init_cache`."""
        cfg = self.config if cfg is None else cfg
        cache = init_cache(cfg, rows, max_len, self.dtype, lookahead, block_size=block_size, num_blocks=num_blocks,
                           kv_cache_dtype=kv_cache_dtype)
        if self.mesh is None:
            return cache
        return jax.device_put(cache, sharding.cache_shardings(cache, self.mesh, cfg.layout))

    def place_rows(self, x):
        """x `[B, ...]` on the devices, split by rows when on a mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        spec = self.config.layout.spec((sharding.BATCH,) + (None,) * (np.ndim(x) - 1), self.mesh)
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

    @property
    def dtype(self):
        return self.embed.get_value().dtype


@partial(jax.jit, static_argnums=2)
def _jit_forward(params, input_ids, cfg):
    return forward(params, input_ids, cfg)
