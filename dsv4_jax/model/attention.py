"""Attention of one layer over a chunk of T tokens per row, row b at positions p0[b] .. p0[b]+T-1,
given the cache. Every row has its own position: its own window-ring slots, compression-block
phase, pool length, RoPE positions and causal limits (`p0` is int32 `[B]`; a scalar is broadcast).

Every layer attends to a sliding window of `sliding_window` keys (the token itself included):
cached ring rows for positions before p0, the chunk's own rows after. Ratio-4 layers add the
indexer's top-k compressed entries, ratio-128 layers every visible compressed entry. Entry j
(pooled from block j, plus block j-1 with overlap) is visible to the query at t iff
j < (t + 1) // ratio, so a block's entry is visible from the token that completes it. Entries
completed inside the chunk are computed here and attended to directly (the cache is only read);
the caller stores them afterwards.

A query's keys are its window and its compressed rows, in one softmax with the per-head sink
(`attend`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels  # looked up at call time: pallas_kernels imports our primitives
from pallas_kernels import kv_record
from pallas_kernels._dispatch import dispatch
from pallas_kernels.numerics import apply_rope, rms_norm, rotate_heads, unweighted_rms_norm
from . import xla_cpu
from .config import ModelConfig
from .layer_kinds import BY_RATIO, CSA
from .indexer import select_topk
from .layer_weights import LayerSlice, own_weight, with_weight
from .linear import dense, weight_array
from .rope import cos_sin
from .sharding import BATCH, HEADS, per_device, rows_axis


def query(p: dict, x: jnp.ndarray, cfg: ModelConfig):
    """x `[B, T, D]` -> (q `[B, T, H, Dh]`, q latent `[B, T, Q]`).

    q = wq_b(q_norm(wq_a x)), not yet normalized per head nor rotated: `attend` scales each head
    by its unweighted RMS and rotates its last dims at the queries' positions (on TPU both inside
    the attention kernel), `rotated_queries` wherever else the queries are needed."""
    c_q = rms_norm(dense(x, p["wq_a"], cfg), p["q_norm"], cfg.rms_norm_eps)
    return dense(c_q, p["wq_b"], cfg).reshape(*x.shape[:-1], cfg.num_heads, cfg.head_dim), c_q


def rotated_queries(q: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray], cfg: ModelConfig) -> jnp.ndarray:
    """`query`'s q `[B, T, H, Dh]` as the attention multiplies it: each head scaled by its
    unweighted RMS, then rotated at the queries' positions (rope = (cos, sin) `[B, T, rope/2]`)."""
    return rotate_heads(unweighted_rms_norm(q, cfg.rms_norm_eps), rope)


def key_value(p: dict, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """x `[B, T, D]` -> the shared K=V row `[B, T, Dh]`: kv_norm(wkv x), rope on its last dims."""
    kv = rms_norm(dense(x, p["wkv"], cfg), p["kv_norm"], cfg.rms_norm_eps)
    return apply_rope(kv, cos, sin)


def output(p: dict, o: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray], cfg: ModelConfig) -> jnp.ndarray:
    """o `[B, T, H, Dh]` as `attend` leaves it (at the queries' rotation) -> `[B, T, D]`: each
    head rotated back at its query's position (rope = (cos, sin) `[B, T, rope/2]`), then the
    grouped low-rank projection (wo_a per group of H/G heads, then wo_b)."""
    B, T = o.shape[:2]
    G = cfg.o_groups

    def grouped(wo_a, o):
        wo_a = weight_array(own_weight(wo_a)).reshape(G, cfg.o_lora_rank, -1)
        o = rotate_heads(o, rope, inverse=True).reshape(B, T, G, -1)
        z = jnp.einsum("btgd,grd->btgr", o.astype(wo_a.dtype), wo_a, preferred_element_type=jnp.float32)
        return z.astype(wo_a.dtype).reshape(B, T, -1)

    wo_a = p["wo_a"]
    # a layer of the stack: read in place by the kernels on TPU and GPU, which rotate o back as they load it
    device = partial(_grouped_output, rope=rope, cfg=cfg) if isinstance(wo_a, LayerSlice) else grouped
    z = xla_cpu.choose(wo_a, o, cpu=partial(with_weight, grouped), device=device)
    return dense(z, p["wo_b"], cfg)


def _grouped_output(wo_a, o: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray], cfg: ModelConfig) -> jnp.ndarray:
    """`output`'s rotation back and grouped projection by `pallas_kernels.block_diagonal_matmul`
    (its x_rope): each of the G groups' columns times its block of wo_a (a LayerSlice `[G*O,
    H*Dh/G]`), read in place in the layer stack (XLA turns a product of a few rows by a layer's
    slice into a float32 copy of the slice), o's heads rotated back in the kernel (in XLA the
    rotation writes o again, whole); per device on a mesh, as the heads are split. o `[B, T, H,
    Dh]` -> `[B, T, G*O]` in wo_a's dtype."""
    batch = rows_axis(cfg, o.shape[0])

    def local(o, cos, sin, stack, layer):
        b, t, h, d = o.shape
        g = cfg.o_groups * h // cfg.num_heads  # this device's groups
        z = pallas_kernels.block_diagonal_matmul(o.reshape(b * t, h * d).astype(stack.dtype),
                                                 stack.reshape(stack.shape[0], g, -1, h * d // g), layer=layer,
                                                 x_rope=(cos.reshape(b * t, -1), sin.reshape(b * t, -1)),
                                                 head_dim=d, impl=cfg.attention_impl)
        return z.reshape(b, t, -1)

    rows = (batch, None, None)
    run = per_device(cfg, local, ((batch, None, HEADS, None), rows, rows, (None, HEADS, None), None),
                     (batch, None, HEADS))
    return run(o, *rope, wo_a.stack, wo_a.index)


def row_positions(p0, batch: int) -> jnp.ndarray:
    """p0 as int32 `[B]`: one first position per row (a scalar is every row's)."""
    return jnp.broadcast_to(jnp.asarray(p0, jnp.int32), (batch,))


def window_indices(p0: jnp.ndarray, T: int, window: int, ring: int) -> jnp.ndarray:
    """`[B, T, W]` int32 indices into [ring (`ring` >= W rows) | chunk (T rows)] for p0 `[B]`: for the
    query at p0 + i the positions p0+i-W+1 .. p0+i, oldest first; before p0 from ring slot
    s % ring, from p0 on the chunk row s - p0; -1 before position 0."""
    p0 = p0[:, None, None]
    s = p0 + jnp.arange(T, dtype=jnp.int32)[:, None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)[None, :]
    idx = jnp.where(s < p0, s % ring, ring + s - p0)
    return jnp.where(s >= 0, idx, -1)


def ring_writes(p0: jnp.ndarray, n_valid: jnp.ndarray, T: int, ring: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Which of a chunk's T rows go into a ring of `ring` slots (position s in slot s % ring): each
    row's last min(T, ring) real tokens. Returns (their chunk rows, clipped to 0, and their slots,
    `ring` (out of range: not written) where a row has fewer real tokens), int32 `[B, min(T, ring)]`."""
    k = min(T, ring)
    rows = n_valid[:, None] - k + jnp.arange(k, dtype=jnp.int32)
    slots = jnp.where(rows >= 0, (p0[:, None] + rows) % ring, ring)
    return jnp.clip(rows, 0), slots


class StateWrites(NamedTuple):
    """Rows of a compressor's state for the caller to write: fp32 `[B, m, C]` each, into the row's
    state slots `slots` int32 `[B, m]` (out of range: not written)."""

    a: jnp.ndarray
    z: jnp.ndarray
    slots: jnp.ndarray


def _folds(ratio: int) -> int:
    """Folded rows a ratio's compressor state keeps: the open block's, and with overlap the block
    before it (whose first halves the open block's entry pools)."""
    return 2 if BY_RATIO[ratio].overlap else 1


def state_writes_rows(ratio: int, T: int, S: int) -> int:
    """m of the StateWrites a chunk of T tokens gives a ratio's compressor with S state slots."""
    f = _folds(ratio)
    return f + min(T, S - f)


def fold_point(p0: jnp.ndarray, n_valid: jnp.ndarray, lookahead: int) -> jnp.ndarray:
    """Where the compressors' folded state rows end after a chunk at p0 `[B]` with n_valid `[B]`
    real tokens (int32 `[B]`): all of them but the last `lookahead`, which a verification may
    reject (the row's position never moves back further, nor before p0)."""
    return jnp.maximum(p0, p0 + n_valid - lookahead)


def _fold(a: jnp.ndarray, z: jnp.ndarray, use: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The rows of a `[B, N, C]` and z `[B, N, C]` where `use` (bool `[B, N]`) folded into one row
    each `[B, C]`: z the log-sum-exp of theirs, a the z-softmax-weighted sum of theirs, so that in
    a per-channel softmax pool the row weighs as they do together; (0, -inf) where none is used."""
    z = jnp.where(use[..., None], z, -jnp.inf)
    m = jnp.max(z, axis=1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(z - m)
    total = jnp.sum(w, axis=1)
    some = total > 0
    safe = jnp.where(some, total, 1.0)
    folded_a = jnp.sum(w * jnp.where(use[..., None], a, 0.0), axis=1) / safe
    return jnp.where(some, folded_a, 0.0), jnp.where(some, m[:, 0] + jnp.log(safe), -jnp.inf)


class _Held(NamedTuple):
    """What a compressor state holds for a chunk at p0 (module doc of compress_chunk), each of its
    S slots as a span of positions [lo, hi) `[B, S]` (empty where the slot holds nothing usable):
    the folded rows' spans, then the ring slots' one position each (those before p0)."""

    lo: jnp.ndarray
    hi: jnp.ndarray


def _held(S: int, ratio: int, p0: jnp.ndarray, folded: jnp.ndarray) -> _Held:
    f, la = _folds(ratio), S - _folds(ratio)
    start = (folded // ratio) * ratio
    spans = [(start - ratio, start), (start, folded)][-f:]  # [the block before,] the open block
    lo = [jnp.maximum(a, 0) for a, _ in spans]
    hi = [b for _, b in spans]
    ring = folded[:, None] + (jnp.arange(la, dtype=jnp.int32)[None, :] - folded[:, None]) % max(la, 1)
    lo, hi = jnp.concatenate([jnp.stack(lo, 1), ring], 1), jnp.concatenate([jnp.stack(hi, 1), ring + 1], 1)
    usable = (folded <= p0)[:, None] & (hi <= p0[:, None])  # a restarted row's state is another sequence's
    return _Held(lo, jnp.where(usable, hi, lo))


def _state_rows(sa, sz, held: _Held, positions):
    """The state as rows at the positions `[B, N]` (a span of consecutive ones): each slot's row at
    its span's first position when the span lies among them, (0, -inf) elsewhere."""
    at = held.lo - positions[:, :1]  # [B, S] the index of each slot's row
    ok = (held.lo < held.hi) & (at >= 0) & (at < positions.shape[1])
    onto = jax.nn.one_hot(jnp.where(ok, at, -1), positions.shape[1], dtype=jnp.bool_)  # [B, S, N]
    hit = jnp.any(onto, axis=1)  # [B, N]
    slot = jnp.argmax(onto, axis=1)[..., None]  # [B, N, 1]
    return (jnp.where(hit[..., None], jnp.take_along_axis(sa, slot, axis=1), 0.0),
            jnp.where(hit[..., None], jnp.take_along_axis(sz, slot, axis=1), -jnp.inf))


def _refold(sa, sz, a, z, p0, n_valid, folded, old: _Held, ratio) -> StateWrites:
    """The compressor state after the chunk (a, z `[B, T, C]` at p0), as writes: each folded row of
    the new fold point (`fold_point`) refolded from what covers its span (`old`: what the state
    held, the chunk), written where the fold point moves; the chunk's last real rows into the ring."""
    B, T, _ = a.shape
    S, f = sa.shape[1], _folds(ratio)
    la = S - f
    end = fold_point(p0, n_valid, la)
    new = _held(S, ratio, end, end)
    t = p0[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    lo = jnp.concatenate([old.lo, jnp.where(t < (p0 + n_valid)[:, None], t, 0)], 1)
    hi = jnp.concatenate([old.hi, jnp.where(t < (p0 + n_valid)[:, None], t + 1, 0)], 1)
    rows_a, rows_z = jnp.concatenate([sa, a], axis=1), jnp.concatenate([sz, z], axis=1)
    folds = [_fold(rows_a, rows_z, (lo < hi) & (lo >= new.lo[:, i:i + 1]) & (hi <= new.hi[:, i:i + 1]))
             for i in range(f)]
    rows, slots = ring_writes(p0, n_valid, T, la) if la else (jnp.zeros((B, 0), jnp.int32),) * 2
    take = lambda v: jnp.take_along_axis(v, rows[..., None], axis=1)  # noqa: E731
    unmoved = (end == folded)[:, None]  # a row that folds nothing (e.g. held) keeps its state
    fold_slots = jnp.where(unmoved, S, jnp.arange(f, dtype=jnp.int32)[None, :])
    return StateWrites(jnp.concatenate([jnp.stack([fa for fa, _ in folds], 1), take(a)], axis=1),
                       jnp.concatenate([jnp.stack([fz for _, fz in folds], 1), take(z)], axis=1),
                       jnp.concatenate([fold_slots, slots + f], axis=1))


def compress_chunk(cp: dict, x: jnp.ndarray, state_a: jnp.ndarray, state_z: jnp.ndarray, p0: jnp.ndarray,
                   ratio: int, freqs: jnp.ndarray, cfg: ModelConfig, layer: jnp.ndarray | None = None,
                   n_valid: jnp.ndarray | None = None, folded: jnp.ndarray | None = None):
    """Runs a compressor over the chunk x `[B, T, D]`, row b at positions p0[b].., with its state.

    The state, state_a/z fp32 `[B, S, C]` (the projections, and the gate scores with `ape`), holds
    what the blocks a later chunk pools need of each row's positions before it, folded: the
    positions of the open block before folded[b] (int32 `[B]`, default p0) as one row (`_fold`:
    their scores' log-sum-exp and their softmax-weighted projections, which weigh in the block's
    per-channel softmax pool as those positions do together), with overlap (ratio 4) first the
    block before it as one row too (its first halves are the open block's entry's other
    candidates), then a ring of the positions from folded[b] on (s in slot folds + s % lookahead).
    A step folds all its tokens but the last S - folds (`fold_point`), which a verification may
    reject (speculative drafts). So the state is folds + lookahead rows, not one or two blocks'.
    Positions before 0 count as missing (weight 0); a row restarted before its fold point
    (`cache.reset_rows`) finds nothing usable in its state.
    n_valid int32 `[B]` (default T): row b's real tokens, the first n_valid[b] of its chunk; the
    rest are padding, which completes no block.
    Returns (entries `[B, n, d]`, row b's entry i being entry p0[b] // ratio + i, i < n =
    (T + ratio - 1) // ratio, zero where i >= n_new[b]; n_new int32 `[B]`, the blocks each row
    completes; the StateWrites for the caller to write into the state).
    With `layer`, state_a/z are the kind's stacks `[n, B, S, C]`, read at that layer.
    """
    B, T, _ = x.shape
    p0 = row_positions(p0, B)
    n_valid = jnp.full((B,), T, jnp.int32) if n_valid is None else n_valid
    folded = p0 if folded is None else folded
    coff = _folds(ratio)
    n = (T + ratio - 1) // ratio
    xf = x.astype(jnp.float32)
    pos = p0[:, None] + jnp.arange(T, dtype=jnp.int32)
    a = dense(xf, cp["wkv"].astype(jnp.float32))
    z = dense(xf, cp["wgate"].astype(jnp.float32)) + cp["ape"].astype(jnp.float32)[pos % ratio]
    first = p0 // ratio
    n_new = (p0 + n_valid) // ratio - first
    base = (first - coff + 1) * ratio  # [B] the span's first position: the previous block, or the current one
    sa, sz = (state_a, state_z) if layer is None else (
        jax.lax.dynamic_index_in_dim(s, layer, keepdims=False) for s in (state_a, state_z))
    held = _held(sa.shape[1], ratio, p0, folded)

    def span():
        """Per row the positions base .. base + (coff + n) * ratio - 1: those below p0 from the state,
        then the chunk from row p0 - base."""
        old_a, old_z = _state_rows(sa, sz, held, base[:, None] + jnp.arange(coff * ratio, dtype=jnp.int32))

        def place(old, new, off, fill):
            row = jnp.concatenate([old, jnp.full((n * ratio, old.shape[-1]), fill, jnp.float32)])
            return jax.lax.dynamic_update_slice_in_dim(row, new, off, axis=0)

        offset = p0 - base
        return (jax.vmap(place, in_axes=(0, 0, 0, None))(old_a, a, offset, 0.0),
                jax.vmap(place, in_axes=(0, 0, 0, None))(old_z, z, offset, -jnp.inf))

    blocks = slice((coff - 1) * ratio, (coff - 1 + n) * ratio)
    prev = slice(0, ratio) if coff == 2 else None
    cos, sin = cos_sin((first[:, None] + jnp.arange(n)) * ratio, freqs)  # [B, n, rope/2]

    def pool():
        span_a, span_z = span()

        def kernel(a, z, norm, cos, sin, *previous):  # previous: (prev_a, prev_z) with overlap
            return pallas_kernels.compress(a, z, norm, cos, sin, ratio=ratio, eps=cfg.rms_norm_eps,
                                           prev_a=previous[0] if previous else None,
                                           prev_z=previous[1] if previous else None,
                                           out_dtype=x.dtype, impl=cfg.attention_impl)

        rows = (BATCH, None, None)
        previous = () if prev is None else (span_a[:, prev], span_z[:, prev])
        run = per_device(cfg, kernel, (rows, rows, None, rows, rows) + (rows,) * len(previous), rows)
        entries = run(span_a[:, blocks], span_z[:, blocks], cp["norm"], cos, sin, *previous)
        return jnp.where((jnp.arange(n) < n_new[:, None])[..., None], entries, 0)  # incomplete blocks are NaN

    if T == 1:  # decode completes a row's block on one step in `ratio`: pool only when some row does
        d = cp["norm"].shape[-1]
        entries = jax.lax.cond(jnp.any(n_new > 0), pool, lambda: jnp.zeros((B, n, d), x.dtype))
    else:
        entries = pool()
    return entries, n_new, _refold(sa, sz, a, z, p0, n_valid, folded, held, ratio)


def _over_pool(pool: jnp.ndarray, new: jnp.ndarray, first_new: jnp.ndarray, axis: int) -> jnp.ndarray:
    """pool with `new` appended along `axis` and then written over it from index first_new[b] in
    row b (axis counts from the batch axis 0)."""
    pad = [(0, 0)] * pool.ndim
    pad[axis] = (0, new.shape[axis])
    put = lambda p, x, at: jax.lax.dynamic_update_slice_in_dim(p, x, at, axis=axis - 1)  # noqa: E731
    return jax.vmap(put)(jnp.pad(pool, pad), new, first_new)


def in_entry_order(pool: jnp.ndarray, entries: jnp.ndarray, first_new: jnp.ndarray) -> jnp.ndarray:
    """The rows to attend to, row j holding entry j: the pool `[B, P, d]` (entries before
    `first_new` `[B]`), the chunk's entries `[B, n, d]` (first_new ..) written over it from row
    first_new. `[B, P + n, d]`; rows after the chunk's entries are never chosen."""
    return _over_pool(pool, entries, first_new, axis=1)


def visible_entries(p0: jnp.ndarray, T: int, ratio: int) -> jnp.ndarray:
    """`[B, T]` number of entries visible to each query of the chunk (p0 `[B]`)."""
    return (p0[:, None] + jnp.arange(T, dtype=jnp.int32) + 1) // ratio


def indexer_logits(ip: dict, x: jnp.ndarray, c_q: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray,
                   keys_pool: jnp.ndarray, new_keys: jnp.ndarray, p0: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """The indexer's score of every entry for each query of the chunk, fp32 `[B, T, N]` in absolute
    entry order, the pool's and the chunk's (visible or not: `visible_entries` says which count).

    x `[B, T, D]`, c_q `[B, T, Q]`, cos/sin `[B, T, rope/2]` at the query positions, keys_pool
    `[B, P, dI]` the cached keys (or their FP8 records, words `[B, P, W]`: the scores decode
    them, on GPU as the kernel loads them), new_keys `[B, n, dI]` the chunk's (its indexer
    compressor's entries, as compress_chunk gives them), p0 `[B]` the rows' first positions."""
    B, T, _ = x.shape
    p0 = row_positions(p0, B)
    q = dense(c_q, ip["wq_b"], cfg).reshape(B, T, cfg.index_n_heads, cfg.index_head_dim)
    q = rotate_heads(q, (cos, sin))
    w = dense(x, ip["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    # Scores in absolute entry order: the pool's, with the new entries' put in at their ids.
    rows = (BATCH, None, None)
    scores = per_device(cfg, partial(pallas_kernels.indexer_scores, impl=cfg.attention_impl),
                        ((BATCH, None, None, None), rows, rows), rows)
    return _over_pool(scores(q, keys_pool, w), scores(q, new_keys, w), p0 // CSA, axis=2)


def indexer_select(scores: jnp.ndarray, p0: jnp.ndarray, pool_rows: int, cfg: ModelConfig) -> jnp.ndarray:
    """The top-min(index_topk, pool_rows) absolute entry ids of `indexer_logits`' scores `[B, T, N]`
    for each query of the chunk (rows at positions p0 `[B]` ..; pool_rows: the key pool's P, the
    width every layer's selection shares): int32 `[B, T, K]`, -1 where fewer are visible."""
    B, T, _ = scores.shape
    return select_topk(scores, visible_entries(row_positions(p0, B), T, CSA), min(cfg.index_topk, pool_rows))


def reuse_measures(q: jnp.ndarray, ring: jnp.ndarray, kv: jnp.ndarray, rows: jnp.ndarray, own: jnp.ndarray,
                   reused: jnp.ndarray, sink: jnp.ndarray, p0: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """What IndexCache changes in a reusing ratio-4 layer (index-cache.md): the layer's attention
    (`attend`: window, chosen compressed rows, sink; q `[B, T, H, Dh]` rotated) with
    its own top-k ids `own` `[B, T, K]` against with the `reused` ids `[B, T, K]` (-1: none) of
    the compressed rows `[B, Nc, Dh]` in entry order. Returns fp32 `[3]`, means over the queries
    with a non-empty own selection:

    - overlap: the fraction of `own` that `reused` contains;
    - js: the Jensen-Shannon divergence (nats, at most ln 2) between the two attention
      distributions, mean over heads. KL itself is infinite wherever the selections differ (each
      puts mass on entries the other gives none);
    - dropped: the attention mass (mean over heads) that the layer with its own ids puts on
      entries the reused ids lack.

    The window and sink keys are the same in both, so their part of each distribution differs
    only by its normaliser: it enters as one term on their total masses."""
    B, T, H, _ = q.shape
    f32 = jnp.float32
    scale = cfg.head_dim ** -0.5
    p0 = row_positions(p0, B)
    qf = q.astype(f32)
    lw, _ = _window_logits(q, ring, kv, p0, scale, cfg.sliding_window)
    rest = jnp.logaddexp(jax.nn.logsumexp(lw, axis=-1), sink.astype(f32))  # [B, T, H] window and sink

    def chosen(ids):  # the chosen rows' logits `[B, T, H, K]`, -inf where none
        picked = jnp.take_along_axis(rows[:, None].astype(f32), jnp.clip(ids, 0)[..., None], axis=2)
        return jnp.where((ids >= 0)[:, :, None, :], jnp.einsum("bthd,btkd->bthk", qf, picked) * scale, -jnp.inf)

    la, lb = chosen(own), chosen(reused)
    za = jnp.logaddexp(rest, jax.nn.logsumexp(la, axis=-1))[..., None]  # [B, T, H, 1]
    zb = jnp.logaddexp(rest, jax.nn.logsumexp(lb, axis=-1))[..., None]
    in_reused = jnp.any((own[..., :, None] == reused[..., None, :]) & (reused[..., None, :] >= 0), -1)  # [B, T, K]
    in_own = jnp.any((reused[..., :, None] == own[..., None, :]) & (own[..., None, :] >= 0), -1)
    pa = jnp.exp(la - za)  # own ids: 0 where none
    pb_at_own = jnp.where(in_reused[:, :, None], jnp.exp(la - zb), 0.0)  # the reused attention on own ids
    pb_only = jnp.where(in_own[:, :, None], 0.0, jnp.exp(lb - zb))  # on reused ids the own lack

    def js(p, r):  # each key's term of JS(p, r): (p log p + r log r - (p + r) log((p + r) / 2)) / 2
        return 0.5 * (jax.scipy.special.xlogy(p, p) + jax.scipy.special.xlogy(r, r)
                      - jax.scipy.special.xlogy(p + r, (p + r) / 2))

    divergence = (js(jnp.exp(rest - za[..., 0]), jnp.exp(rest - zb[..., 0])) + jnp.sum(js(pa, pb_at_own), -1)
                  + jnp.sum(js(jnp.zeros_like(pb_only), pb_only), -1))  # [B, T, H]
    dropped = jnp.sum(jnp.where(in_reused[:, :, None], 0.0, pa), -1)
    n_own = jnp.sum(own >= 0, axis=-1)
    overlap = jnp.sum(in_reused & (own >= 0), axis=-1) / jnp.maximum(n_own, 1)
    has = n_own > 0

    def mean(v):  # over the queries with an own selection
        return jnp.sum(jnp.where(has, v, 0.0)) / jnp.maximum(jnp.sum(has), 1)

    return jnp.stack([mean(overlap), mean(jnp.mean(divergence, -1)), mean(jnp.mean(dropped, -1))]).astype(f32)


def attend(q: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray], ring: jnp.ndarray, kv: jnp.ndarray,
           comp_rows: jnp.ndarray | None, comp_idx: jnp.ndarray | None, sink: jnp.ndarray, p0: jnp.ndarray,
           cfg: ModelConfig) -> jnp.ndarray:
    """Attention of the chunk's queries q `[B, T, H, Dh]` (row b at positions p0[b] ..) over their
    window of cfg.sliding_window positions (ring `[B, R, Dh]`, R >= the window, slot s % R
    holding position s < p0; the chunk's own rows kv `[B, T, Dh]`) and, for compressed layers,
    the rows comp_idx `[B, T, Kc]` (-1: none) of comp_rows `[B, Nc, Dh]`; one softmax with the
    per-head sink. q comes as `query` leaves it, before its per-head norm and unrotated: each
    head is normalized and then rotated by rope = (cos, sin) `[B, T, rope/2]` at the queries'
    positions before the products (`rotated_queries`). On TPU the attention kernel does both in
    VMEM (in XLA, the norm and rotating a head's last 64 dims of 512 re-lay the whole queries
    out); on GPU one Pallas pass before the kernel; elsewhere XLA before the reference
    (`pallas_kernels.sparse_attention`). The output stays at the queries' rotation: `output`
    rotates it back, inside its projection kernel on TPU and GPU.

    ring, kv and comp_rows may be FP8 records instead (uint32 words, `pallas_kernels.kv_record`; all
    three or none, as the cache holds them, cache.py): the kernels decode the rows they gather.

    Decode (T = 1) and the Pallas kernels take the index form: one row of indices per query into
    [ring | chunk | compressed rows] (`pallas_kernels.sparse_attention`). A chunk on the plain
    XLA path (impl "ref", or "auto" off TPU / GPU) computes the same sum with the window part as
    dense products over blocks of consecutive queries (`_window_blocked`): gathering W rows of
    Dh per query costs several times more than the matmuls on CPU.
    """
    T, R = q.shape[1], ring.shape[1]
    p0 = row_positions(p0, q.shape[0])
    rope_dim = cfg.rope_head_dim if ring.dtype == jnp.uint32 else None

    def indexed():
        idx = window_indices(p0, T, cfg.sliding_window, R)
        rows = [ring, kv]
        if comp_rows is not None:
            idx = jnp.concatenate([idx, jnp.where(comp_idx >= 0, comp_idx + R + T, -1)], axis=-1)
            rows.append(comp_rows)
        kernel = partial(pallas_kernels.sparse_attention, scale=cfg.head_dim ** -0.5, impl=cfg.attention_impl,
                         rope_dim=rope_dim, q_norm_eps=cfg.rms_norm_eps)
        run = per_device(cfg, kernel,
                         ((BATCH, None, HEADS, None), (BATCH, None, None), (BATCH, None, None), (HEADS,),
                          (BATCH, None, None)),
                         (BATCH, None, HEADS, None))
        return run(q, jnp.concatenate(rows, axis=1), idx, sink, rope)

    def blocked():
        def values(rows):
            return None if rows is None else kv_record.read(rows, cfg.head_dim, cfg.rope_head_dim, q.dtype)

        return _window_blocked(rotated_queries(q, rope, cfg), values(ring), values(kv), values(comp_rows), comp_idx,
                               sink, p0, cfg.head_dim ** -0.5, cfg.sliding_window)

    if T == 1:
        return indexed()
    # the kernels' choice of implementation, with the blocked form in the reference's place
    return dispatch(cfg.attention_impl, ref=blocked, tpu=indexed, gpu=indexed, interpret=indexed)()


def _window_logits(q, ring, kv, p0, scale, W):
    """The window part of `_window_blocked`, fp32: each query's logits over its block's keys
    `[B, T, H, Bq + W]` (-inf where not in its window) and the blocks of keys `[B, nb, Bq + W, D]`.
    Row b's window keys, in position order, are seq = [ring by position (p0[b] - W ..) | chunk],
    row m at position p0[b] - W + m; the query at chunk row i is seq row W + i and sees seq rows
    i + 1 .. i + W. Queries go in blocks of Bq = min(T, W): block n sees the Bq + W rows from seq
    row n * Bq, one matmul per block."""
    B, T, H, D = q.shape
    bq = min(T, W)
    nb = -(-T // bq)
    tp = nb * bq
    f32 = jnp.float32
    slots = (p0[:, None] - W + jnp.arange(W, dtype=jnp.int32)) % ring.shape[1]
    ring_by_pos = jnp.take_along_axis(ring, slots[..., None], axis=1)
    seq = jnp.concatenate([ring_by_pos, kv, jnp.zeros((B, tp - T, D), kv.dtype)], axis=1).astype(f32)
    k1 = bq + W
    start = jnp.arange(nb, dtype=jnp.int32) * bq
    key_rows = start[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]  # [nb, k1] into seq
    blocks = jnp.take(seq, key_rows, axis=1)  # [B, nb, k1, D]
    r, m = jnp.arange(bq)[:, None], jnp.arange(k1)[None, :]
    started = (p0[:, None, None] - W + key_rows[None] >= 0)[:, :, None, :]  # [B, nb, 1, k1]
    visible = ((m >= r + 1) & (m <= r + W))[None, None] & started  # [B, nb, bq, k1]
    qf = jnp.pad(q.astype(f32), ((0, 0), (0, tp - T), (0, 0), (0, 0))).reshape(B, nb, bq, H, D)
    lw = jnp.einsum("bnqhd,bnkd->bnqhk", qf, blocks) * scale
    lw = jnp.where(visible[:, :, :, None, :], lw, -jnp.inf).reshape(B, tp, H, k1)[:, :T]
    return lw, blocks


def _window_blocked(q, ring, kv, comp_rows, comp_idx, sink, p0, scale, W):
    """`attend` for T > 1 in plain XLA, fp32, window W (`_window_logits`)."""
    B, T, H, D = q.shape
    p0 = row_positions(p0, B)
    lw, blocks = _window_logits(q, ring, kv, p0, scale, W)
    nb, k1 = blocks.shape[1:3]
    bq = k1 - W
    tp = nb * bq
    f32 = jnp.float32
    sink = sink.astype(f32)
    m_all = jnp.maximum(jnp.max(lw, axis=-1), sink)  # [B, T, H]
    if comp_rows is not None:
        m_all, denom_c, out_c = _compressed(q.astype(f32), comp_rows.astype(f32), comp_idx, m_all, scale)
    pw = jnp.exp(lw - m_all[..., None])
    denom = jnp.sum(pw, axis=-1) + jnp.exp(sink - m_all)
    pw = jnp.pad(pw, ((0, 0), (0, tp - T), (0, 0), (0, 0))).reshape(B, nb, bq, H, k1)
    out = jnp.einsum("bnqhk,bnkd->bnqhd", pw, blocks).reshape(B, tp, H, D)[:, :T]
    if comp_rows is not None:
        denom, out = denom + denom_c, out + out_c
    return (out / denom[..., None]).astype(q.dtype)


# Rows per tile of the compressed rows in `_compressed_tiles`.
COMPRESSED_TILE = 128


def _compressed(q, rows, comp_idx, m_all, scale):
    """The compressed rows' part of `_window_blocked`, fp32: q `[B, T, H, D]`, rows `[B, Nc, D]`,
    comp_idx `[B, T, Kc]` (-1: none), m_all `[B, T, H]` the window's and sink's max. Returns
    (m_all raised to the chosen rows' logits, their sum of exp(logit - m_all) `[B, T, H]`, and
    of exp(logit - m_all) * row `[B, T, H, D]`).

    Two forms: the masked products over the rows up to the highest chosen one (`_compressed_tiles`),
    or each query's Kc rows gathered (`_compressed_gathered`), which copies Kc rows of D per query
    and multiplies them query by query: several times slower per row on CPU, so only taken when
    the rows in use exceed 16 x Kc (ratio 4 with a long context; ratio 128 chooses every row)."""
    Nc, Kc = rows.shape[1], comp_idx.shape[-1]
    if Nc <= 16 * Kc:
        return _compressed_tiles(q, rows, comp_idx, m_all, scale)
    return jax.lax.cond(jnp.max(comp_idx) < 16 * Kc, _compressed_tiles, _compressed_gathered,
                        q, rows, comp_idx, m_all, scale)


def _compressed_tiles(q, rows, comp_idx, m_all, scale):
    """`_compressed` as masked dense products: each query's rows are distinct, so attending to them
    is attending to every row with the others masked; two plain matmuls per tile of
    COMPRESSED_TILE rows, over the tiles up to the highest chosen row only (a chunk early in a long
    cache sees a small prefix of its pool). One pass for the logits and their max, one for the
    exps and the weighted rows."""
    B, T, H, D = q.shape
    Nc = rows.shape[1]
    tile = min(Nc, COMPRESSED_TILE)
    n_tiles = -(-Nc // tile)
    rows = jnp.pad(rows, ((0, 0), (0, n_tiles * tile - Nc), (0, 0)))
    chosen = jnp.zeros((B, T, n_tiles * tile + 1), bool).at[
        jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], jnp.where(comp_idx >= 0, comp_idx, n_tiles * tile)
    ].set(True)[..., :-1]

    def cols(j):  # tile j's rows `[B, tile, D]`
        return jax.lax.dynamic_slice_in_dim(rows, j * tile, tile, axis=1)

    def logits(j):  # `[B, T, H, tile]`, -inf where not chosen
        lc = jnp.einsum("bthd,bnd->bthn", q, cols(j)) * scale
        return jnp.where(jax.lax.dynamic_slice_in_dim(chosen, j * tile, tile, axis=2)[:, :, None, :], lc, -jnp.inf)

    def weigh(j, lc, m_all):
        pc = jnp.exp(lc - m_all[..., None])
        return jnp.sum(pc, axis=-1), jnp.einsum("bthn,bnd->bthd", pc, cols(j))

    if n_tiles == 1:
        lc = logits(0)
        m_all = jnp.maximum(m_all, jnp.max(lc, axis=-1))
        return (m_all, *weigh(0, lc, m_all))

    # scans with the tiles past the highest chosen row skipped (not dynamic-length loops: the
    # model is trained through this, and reverse mode needs a static trip count)
    used = (jnp.max(comp_idx) + tile) // tile  # tiles up to the highest chosen row; 0 if none
    tiles = jnp.arange(n_tiles)

    def first(m, j):
        lc = jax.lax.cond(j < used, logits, lambda j: jnp.full((B, T, H, tile), -jnp.inf, q.dtype), j)
        return jnp.maximum(m, jnp.max(lc, axis=-1)), lc

    m_all, lcs = jax.lax.scan(first, m_all, tiles)
    nothing = (jnp.zeros((B, T, H), q.dtype), jnp.zeros((B, T, H, D), q.dtype))

    def second(carry, j):
        d, o = jax.lax.cond(j < used, lambda j: weigh(j, lcs[j], m_all), lambda j: nothing, j)
        return (carry[0] + d, carry[1] + o), None

    (denom, out), _ = jax.lax.scan(second, nothing, tiles)
    return m_all, denom, out


def _compressed_gathered(q, rows, comp_idx, m_all, scale):
    """`_compressed` on each query's own Kc rows, gathered."""
    valid = comp_idx >= 0
    rows = jnp.take_along_axis(rows[:, None], jnp.where(valid, comp_idx, 0)[..., None], axis=2)  # [B, T, Kc, D]
    lc = jnp.einsum("btkd,bthd->btkh", rows, q) * scale
    lc = jnp.where(valid[..., None], lc, -jnp.inf)
    m_all = jnp.maximum(m_all, jnp.max(lc, axis=2))
    pc = jnp.exp(lc - m_all[:, :, None, :])
    return m_all, jnp.sum(pc, axis=2), jnp.einsum("btkh,btkd->bthd", pc, rows)
