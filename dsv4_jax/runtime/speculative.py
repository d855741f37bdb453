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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv4_jax.model.deepseek_v4 import step
from dsv4_jax.model.mtp import mtp_step
from . import sampling


# What a run of speculation counts, by vLLM's names, the same in `generate`'s `speculation`, the
# Engine's stats, `/metrics` (under `dsv4:`) and dsv4-bench-serve's report: drafts proposed (one a
# round per row), draft tokens proposed, draft tokens kept, and (`accepted_at(i)`) drafts whose
# i-th token was kept.
NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS = (
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
SPEC_DECODE_COUNTERS = (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS)


def accepted_at(i: int) -> str:
    return f"{NUM_ACCEPTED_TOKENS}_pos_{i}"


def acceptance(drafts: float, draft_tokens: float, accepted: float) -> dict:
    """acceptance_rate = accepted / draft tokens; acceptance_length = 1 + accepted / drafts, the
    tokens a row gets per main-model step (None where nothing was drafted)."""
    return {"acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
            "acceptance_length": 1 + accepted / drafts if drafts > 0 else None}


class Pending(NamedTuple):
    """The block's rows a sequence has yet to run: the main model's positions pos - n .. pos - 1
    (the block is at pos - n), each with the main model's hidden streams there and the token after."""

    hidden: jnp.ndarray  # [B, k + 1, hc, D]
    ids: jnp.ndarray  # int32 [B, k + 1]
    n: jnp.ndarray  # int32 [B]


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


def fold(keys: jnp.ndarray, tag: int) -> jnp.ndarray:
    """Each row's key `[B, 2]` folded with `tag`: a stream of its own for each use in a round."""
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
        tokens.append(_draw(q, fold(keys, 2 * i)))
        dists.append(q)
    return jnp.stack(tokens, 1), jnp.stack(dists, 1), {**mtp_cache, "pos": kept}


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
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.wrap_key_data(key), (k,)))(fold(keys, 2 * k + 1))
    kept = jnp.sum(jnp.cumprod((u * q < p) & proposed, axis=1), axis=1).astype(jnp.int32)
    p_j = jnp.take_along_axis(target, kept[:, None, None], axis=1)[:, 0]
    draft = jnp.where(proposed[..., None], draft, 0.0)  # a draft never proposed takes nothing from p
    q_j = jnp.take_along_axis(jnp.pad(draft, ((0, 0), (0, 1), (0, 0))), kept[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_j - q_j, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_j)
    return kept, _draw(residual / jnp.sum(residual, axis=-1, keepdims=True), fold(keys, 2 * k + 2))


class BlockDrafts(NamedTuple):
    """The drafts of the checkpoint's MTP block (its parameters `block`): the draft source of
    `verify_round`. A draft source is any pytree with this `draft` method."""

    block: dict

    def draft(self, params: dict, state, active: jnp.ndarray, drawn: jnp.ndarray, keys, sampling_params, k: int,
              cfg):
        """k drafts for every active row (bool `[B]`; drawn `[B]`: the tokens each row has): (drafts
        int32 `[B, k]`, the distributions they were drawn from `[B, k, V]`, the state)."""
        pending = state.pending._replace(n=state.pending.n * active)
        drafts, dists, mtp_cache = draft_with_block(self.block, params["embed"], params["head"], state.mtp_cache,
                                                    pending, k, keys, sampling_params, cfg)
        return drafts, dists, state._replace(mtp_cache=mtp_cache)

    def for_rows(self, rows: int) -> "BlockDrafts":
        """The source for a batch padded to `rows` rows."""
        return self


def start(pending: Pending, at, ends: jnp.ndarray, carry: jnp.ndarray, tokens: jnp.ndarray) -> Pending:
    """`pending` with the rows `at` (int `[R]` or a slice) whose prompt `ends` (bool `[R]`) given
    their first block row: the hidden streams at the last prompt position (`carry` `[R, hc, D]`)
    and the token sampled after it (`tokens` `[R]`)."""
    first = ends[:, None, None, None] & (jnp.arange(pending.hidden.shape[1]) == 0)[None, :, None, None]
    return Pending(pending.hidden.at[at].set(jnp.where(first, carry[:, None], pending.hidden[at])),
                   pending.ids.at[at, 0].set(jnp.where(ends, tokens, pending.ids[at, 0])),
                   pending.n.at[at].set(jnp.where(ends, 1, pending.n[at])))


def verify_round(params: dict, drafter, state, last: jnp.ndarray, active: jnp.ndarray, limit: jnp.ndarray | None,
                 sample, k: int, cfg):
    """One round for every active row (bool `[B]`; the others hold): k drafts from `drafter` (a
    draft source: `BlockDrafts`, or a test's), [last token `last` `[B]` + drafts] through the main
    model, then `accept` (at most limit[b] drafts kept; None: k). state: a decode.DecodeState;
    sample: its decode.Sampling, `drawn` the tokens each row has; the main model's distributions
    are those of its logits after each row's controls (sample.adjusted, position i counting i more
    tokens drawn). Returns (the state, each row at its position after its kept tokens; the row's
    new tokens int32 `[B, k + 1]` (the first kept + 1 are real: the kept drafts, then the main
    model's token); kept `[B]`; the main model's raw logits `[B, k + 1, V]`)."""
    B = last.shape[0]
    V = cfg.vocab_size
    keys = sample.keys()
    drafts, dists, state = drafter.draft(params, state, active, sample.drawn, keys, sample.params, k, cfg)
    q0 = state.cache["pos"]
    ids = jnp.concatenate([last[:, None], drafts], axis=1)
    out = step(params, state.cache, ids, cfg, False, n_valid=active * (k + 1), return_hidden=True)
    logits = jnp.stack([sample.adjusted(out.logits[:, i], state, i) for i in range(k + 1)], axis=1)
    per_position = (jnp.repeat(jnp.broadcast_to(jnp.asarray(a), (B,)), k + 1) for a in sample.params)
    target = sampling.distribution(logits.reshape(B * (k + 1), V), *per_position).reshape(B, k + 1, V)
    kept, nxt = accept(target, dists, drafts, keys, limit)
    i = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    tokens = jnp.where(i < kept[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
    cache = {**out.cache, "pos": jnp.where(active, q0 + kept + 1, q0)}
    pending = jax.tree.map(lambda new, old: jnp.where(active.reshape((B,) + (1,) * (new.ndim - 1)), new, old),
                           Pending(out.hidden, tokens, kept + 1), state.pending)  # the rows that hold keep theirs
    return state._replace(cache=cache, pending=pending), tokens, kept, out.logits
