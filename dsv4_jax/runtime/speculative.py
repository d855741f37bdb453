"""Speculative decoding with the checkpoint's MTP block (dsv4_jax/model/mtp.py).

Each round the block drafts k tokens per row, the main model runs [the row's last token + its k
drafts] as one chunk, and each row keeps the longest prefix of drafts the main model agrees with
plus one token of the main model's own: 1 to k + 1 tokens per row per round, rows keeping
different numbers in the same round.

Acceptance. Draft i is kept with probability min(1, p(d) / q(d)), p the main model's distribution
at that position and q the block's, both after temperature, top-k and top-p
(`sampling.distribution`); at the first rejection the row's token is drawn from max(0, p - q)
renormalised, and when every draft is kept, from p at the position after them. The tokens are
then distributed exactly as the main model's alone. At temperature 0 both distributions are
one-hot, so a draft is kept while it is the main model's argmax and the token after the kept ones
is the main model's argmax: greedy output is token for token the output without speculation.

State. Nothing a rejected draft touched survives. Every cache is addressed by position, and the
rings (the main model's window and compressor rings, the block's window ring) are `lookahead` = k
slots wider than they must be (dsv4_jax/model/cache.py). The verification writes positions q .. q + k;
the row's position is then set to q + j + 1 (j drafts kept), so what the rejected drafts wrote
(ring slots, compressor rows, pool entries of blocks they completed, indexer keys) lies at or after
the row's position: never read, and overwritten by its next tokens. The block is kept exact the
same way: each round first runs it over the positions the last round kept, on the main model's
hidden streams there (from the verification), then drafts on from its own output; the drafts'
rows lie past the block's position, which is set back after drafting.

The block's row at position t takes the main model's hidden streams at t and the token at t + 1,
and predicts the token at t + 2 (architecture.md §9).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv4_jax.model.deepseek_v4 import Model, step
from dsv4_jax.model.mtp import init_mtp_cache, mtp_step
from . import sampling
from .buckets import PREFILL_CHUNK, prefill_chunks


class Pending(NamedTuple):
    """The block's rows a sequence has yet to run: the main model's positions pos - n .. pos - 1
    (the block is at pos - n), each with the main model's hidden streams there and the token after."""

    hidden: jnp.ndarray  # [B, k + 1, hc, D]
    ids: jnp.ndarray  # int32 [B, k + 1]
    n: jnp.ndarray  # int32 [B]


class Forced(NamedTuple):
    """Drafts from a known continuation instead of the block (tests and benchmarks: a chosen
    acceptance). reference int32 `[B, N]`: each row's tokens from its first generated one on (what
    the main model will produce); a draft for generated token g is reference[g] where it is to be
    right, else reference[g] + 1 (mod V). Draft i of a round is right when i < count[b] and a
    uniform draw is below rate[b]."""

    reference: jnp.ndarray  # int32 [B, N]
    count: jnp.ndarray  # int32 [B]
    rate: jnp.ndarray  # fp32 [B]


def prefill_block(mtp: dict, embed, head, mtp_cache: dict, hidden: jnp.ndarray, ids: jnp.ndarray, p0: jnp.ndarray,
                  n_valid: jnp.ndarray, carry: jnp.ndarray, cfg):
    """The block's rows for the positions a prefill chunk of the main model covers, one behind:
    positions p0 - 1 .. p0 + n_valid - 2 (from 0), each with the main model's hidden streams there
    (carry `[B, hc, D]`: those at p0 - 1, from the previous chunk; then the chunk's `hidden`
    `[B, T, hc, D]`) and the chunk's token after it (`ids` `[B, T]`). Returns (the block's cache,
    the new carry: the streams at each row's last real position)."""
    B, T = ids.shape
    ext_hidden = jnp.concatenate([carry[:, None], hidden], axis=1)  # [B, T + 1], row e at position p0 - 1 + e
    ext_ids = jnp.concatenate([ids, jnp.zeros((B, 1), ids.dtype)], axis=1)
    shift = (p0 == 0).astype(jnp.int32)  # no position -1: start one later
    at = jnp.arange(T, dtype=jnp.int32)[None, :] + shift[:, None]
    rows_hidden = jnp.take_along_axis(ext_hidden, at[:, :, None, None], axis=1)
    rows_ids = jnp.take_along_axis(ext_ids, at, axis=1)
    n = jnp.maximum(n_valid - shift, 0)
    _, _, mtp_cache = mtp_step(mtp, embed, head, mtp_cache, rows_hidden, rows_ids, cfg, n_valid=n)
    last = jnp.take_along_axis(hidden, jnp.clip(n_valid - 1, 0)[:, None, None, None], axis=1)[:, 0]
    return mtp_cache, jnp.where((n_valid > 0)[:, None, None], last, carry)


def _draw(probs: jnp.ndarray, keys: jnp.ndarray) -> jnp.ndarray:
    """One token per row from `probs` `[B, V]` with raw keys `[B, 2]` (deterministic for a one-hot)."""
    return jax.vmap(lambda p, k: jax.random.categorical(jax.random.wrap_key_data(k), jnp.log(p)))(
        probs, keys).astype(jnp.int32)


def _fold(keys: jnp.ndarray, tag: int) -> jnp.ndarray:
    return jax.vmap(lambda k: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), tag)))(keys)


def draft_with_block(mtp: dict, embed, head, mtp_cache: dict, pending: Pending, k: int, keys, sampling_params,
                     cfg):
    """k drafts per row: the block runs its pending rows (its last row predicts the first draft),
    then k - 1 steps on its own output streams. Returns (drafts int32 `[B, k]`, the block's
    distributions they were drawn from `[B, k, V]`, the block's cache at the position after the
    pending rows)."""
    logits, streams, mtp_cache = mtp_step(mtp, embed, head, mtp_cache, pending.hidden, pending.ids, cfg,
                                          n_valid=pending.n)
    kept = mtp_cache["pos"]
    last = jnp.clip(pending.n - 1, 0)[:, None, None]
    lg = jnp.take_along_axis(logits, last, axis=1)[:, 0]
    h = jnp.take_along_axis(streams, last[..., None], axis=1)  # [B, 1, hc, D]
    active = (pending.n > 0).astype(jnp.int32)
    tokens, dists = [], []
    for i in range(k):
        if i:
            lg, h, mtp_cache = mtp_step(mtp, embed, head, mtp_cache, h, tokens[-1][:, None], cfg, n_valid=active)
            lg = lg[:, 0]
        q = sampling.distribution(lg, *sampling_params)
        tokens.append(_draw(q, _fold(keys, 2 * i)))
        dists.append(q)
    return jnp.stack(tokens, 1), jnp.stack(dists, 1), {**mtp_cache, "pos": kept}


def forced_drafts(forced: Forced, n_gen: jnp.ndarray, k: int, keys, vocab: int):
    """k drafts per row from `forced` for the tokens after the n_gen a row has: (drafts `[B, k]`,
    one-hot distributions `[B, k, V]`)."""
    i = jnp.arange(k, dtype=jnp.int32)[None, :]
    want = jnp.take_along_axis(forced.reference, jnp.clip(n_gen[:, None] + i, 0, forced.reference.shape[1] - 1),
                               axis=1)
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.wrap_key_data(key), (k,)))(_fold(keys, 1))
    right = (i < forced.count[:, None]) & (u < forced.rate[:, None])
    drafts = jnp.where(right, want, (want + 1) % vocab).astype(jnp.int32)
    return drafts, jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)


def accept(target: jnp.ndarray, draft: jnp.ndarray, drafts: jnp.ndarray, keys,
           limit: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Rejection sampling of the drafts `[B, k]` (drawn from `draft` `[B, k, V]`) against the main
    model's distributions `target` `[B, k + 1, V]` at the same positions and the one after. Returns
    (the drafts each row keeps, j `[B]`; the row's next token `[B]`: from max(0, p - q) at the
    first rejection, from p after the last draft when all are kept). limit `[B]` (default k): a
    row proposes only its first limit[b] drafts (a request asking for fewer); its token after them
    comes from p."""
    B, k = drafts.shape
    i = jnp.arange(k)[None, :]
    proposed = i < (k if limit is None else limit[:, None])
    p = jnp.take_along_axis(target[:, :k], drafts[..., None], axis=-1)[..., 0]
    q = jnp.take_along_axis(draft, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.wrap_key_data(key), (k,)))(_fold(keys, 2 * k + 1))
    kept = jnp.sum(jnp.cumprod((u * q < p) & proposed, axis=1), axis=1).astype(jnp.int32)
    p_j = jnp.take_along_axis(target, kept[:, None, None], axis=1)[:, 0]
    draft = jnp.where(proposed[..., None], draft, 0.0)  # a draft never proposed takes nothing from p
    q_j = jnp.take_along_axis(jnp.pad(draft, ((0, 0), (0, 1), (0, 0))), kept[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_j - q_j, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_j)
    return kept, _draw(residual / jnp.sum(residual, axis=-1, keepdims=True), _fold(keys, 2 * k + 2))


def verify_round(params: dict, mtp: dict | None, cache: dict, mtp_cache: dict, last: jnp.ndarray, pending: Pending,
                 active: jnp.ndarray, n_gen: jnp.ndarray, seeds: jnp.ndarray, sampling_params, k: int, cfg,
                 forced: Forced | None = None, limit: jnp.ndarray | None = None):
    """One round for every active row (bool `[B]`; the others hold): draft k tokens (the block, or
    `forced`), run [last token `last` `[B]` + drafts] through the main model, accept (at most
    limit[b] drafts, `accept`). Returns
    (the cache at each row's position after its kept tokens, the block's cache, the new Pending,
    the row's new tokens int32 `[B, k + 1]` (the first kept + 1 are real: the kept drafts, then
    the main model's token), kept `[B]`)."""
    B = last.shape[0]
    V = cfg.vocab_size
    keys = sampling.row_keys(seeds, n_gen)
    if forced is None:
        drafts, dists, mtp_cache = draft_with_block(mtp, params["embed"], params["head"], mtp_cache,
                                                    pending._replace(n=pending.n * active), k, keys,
                                                    sampling_params, cfg)
    else:
        drafts, dists = forced_drafts(forced, n_gen, k, keys, V)
    q0 = cache["pos"]
    ids = jnp.concatenate([last[:, None], drafts], axis=1)
    logits, cache, hidden = step(params, cache, ids, cfg, False, n_valid=active * (k + 1), return_hidden=True)
    t, top_k, top_p = (jnp.repeat(jnp.broadcast_to(jnp.asarray(a), (B,)), k + 1) for a in sampling_params)
    target = sampling.distribution(logits.reshape(B * (k + 1), V), t, top_k, top_p).reshape(B, k + 1, V)
    kept, nxt = accept(target, dists, drafts, keys, limit)
    i = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    tokens = jnp.where(i < kept[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
    cache = {**cache, "pos": jnp.where(active, q0 + kept + 1, q0)}
    pending = jax.tree.map(lambda new, old: jnp.where(active.reshape((B,) + (1,) * (new.ndim - 1)), new, old),
                           Pending(hidden, tokens, kept + 1), pending)  # the rows that hold keep theirs
    return cache, mtp_cache, pending, tokens, kept


def _stops(tokens: jnp.ndarray, eos: jnp.ndarray) -> jnp.ndarray:
    return jnp.any(tokens[..., None] == eos, axis=-1)


@partial(jax.jit, static_argnums=(12, 13), donate_argnums=(2, 3))
def decode_loop(params, mtp, cache, mtp_cache, logits, carry, buf, done, max_new, seeds, sampling_params, eos, k, cfg,
                forced=None):
    """`generate`'s decode loop with speculation (k drafts a round): samples each row's first token
    from the prefill's `logits` `[B, V]`, then runs `verify_round`s until every row is done (a stop
    id in `eos`, or max_new tokens). carry `[B, hc, D]`: the main model's hidden streams at each
    row's last prompt position (`prefill_block`). buf `[B, max_len]` receives each row's tokens at
    their positions; done `[B]`: rows that take no part. Returns (buf, tokens generated per row,
    the counters {rounds, drafts, draft_tokens, accepted_tokens, accepted_per_position `[k]`}, the
    cache, the block's cache)."""
    B, max_len = buf.shape
    rows = jnp.arange(B)[:, None]
    first = jnp.where(done, 0, sampling.sample(logits, sampling.row_keys(seeds, jnp.zeros_like(seeds, jnp.int32)),
                                               *sampling_params))
    buf = buf.at[rows[:, 0], jnp.where(done, max_len, cache["pos"])].set(first, mode="drop")
    n_gen = (~done).astype(jnp.int32)
    done = done | _stops(first, eos) | (n_gen >= max_new)
    hidden = jnp.zeros((B, k + 1) + carry.shape[1:], carry.dtype).at[:, 0].set(carry)
    pending = Pending(hidden, jnp.zeros((B, k + 1), jnp.int32).at[:, 0].set(first), (~done).astype(jnp.int32))
    counters = {"rounds": jnp.int32(0), "drafts": jnp.int32(0), "draft_tokens": jnp.int32(0),
                "accepted_tokens": jnp.int32(0), "accepted_per_position": jnp.zeros((k,), jnp.int32)}
    i = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

    def body(s):
        cache, mtp_cache, pending, last, buf, n_gen, done, counters = s
        active = ~done
        q = cache["pos"]
        cache, mtp_cache, pending, tokens, kept = verify_round(params, mtp, cache, mtp_cache, last, pending, active,
                                                               n_gen, seeds, sampling_params, k, cfg, forced)
        emit = jnp.where(active, jnp.minimum(kept + 1, max_new - n_gen), 0)  # the real tokens, within the limit
        stop = _stops(tokens, eos) & (i < emit[:, None])
        emit = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, emit)  # through the first stop id
        buf = buf.at[rows, jnp.where(i < emit[:, None], q[:, None] + 1 + i, max_len)].set(tokens, mode="drop")
        n_gen = n_gen + emit
        done = done | jnp.any(stop, axis=1) | (n_gen >= max_new)
        last = jnp.take_along_axis(tokens, kept[:, None], axis=1)[:, 0]
        n_active = jnp.sum(active, dtype=jnp.int32)
        counters = {"rounds": counters["rounds"] + 1, "drafts": counters["drafts"] + n_active,
                    "draft_tokens": counters["draft_tokens"] + k * n_active,
                    "accepted_tokens": counters["accepted_tokens"] + jnp.sum(jnp.where(active, kept, 0)),
                    "accepted_per_position": counters["accepted_per_position"]
                    + jnp.sum((jnp.arange(k)[None, :] < kept[:, None]) & active[:, None], axis=0, dtype=jnp.int32)}
        return cache, mtp_cache, pending, last, buf, n_gen, done, counters

    state = (cache, mtp_cache, pending, first, buf, n_gen, done, counters)
    cache, mtp_cache, _, _, buf, n_gen, _, counters = jax.lax.while_loop(lambda s: ~jnp.all(s[6]), body, state)
    return buf, n_gen, counters, cache, mtp_cache


@partial(jax.jit, static_argnums=(9,), donate_argnums=(2, 3))
def _prefill_chunk(params, mtp, cache, mtp_cache, ids, n_valid, ends, logits, carry, cfg):
    """generate's prefill chunk (`generate._prefill`) with the block's rows for it (`prefill_block`)."""
    p0 = cache["pos"]
    last, cache, hidden = step(params, cache, ids, cfg, True, n_valid=n_valid, return_hidden=True)
    mtp_cache, carry = prefill_block(mtp, params["embed"], params["head"], mtp_cache, hidden, ids, p0, n_valid, carry,
                                     cfg)
    return jnp.where(ends[:, None], last[:, 0], logits), cache, mtp_cache, carry


def prefill(model: Model, params: dict, cfg, prompts, lengths, max_len: int, k: int, chunk: int = PREFILL_CHUNK):
    """`generate.prefill` for speculation: caches with rings k slots wider (module doc), and the
    block run over the prompts. Returns (each row's logits after its last prompt token, the cache,
    the block's cache, the main model's hidden streams at each row's last prompt position)."""
    B = len(lengths)
    with model.on_mesh():
        cache = model.new_cache(B, max_len, cfg, lookahead=k)
        mtp_cache = init_mtp_cache(cfg, B, model.dtype, lookahead=k)
        logits = jnp.zeros((B, cfg.vocab_size), jnp.float32)
        carry = jnp.zeros((B, cfg.hc_mult, cfg.hidden_size), model.dtype)
        for ids, n, ends in prefill_chunks(prompts, lengths, chunk):
            logits, cache, mtp_cache, carry = _prefill_chunk(params, model.mtp, cache, mtp_cache, ids, n, ends, logits,
                                                             carry, cfg)
    return logits, cache, mtp_cache, carry
