"""The one seam between requests and the model: the decode state, and the only jitted programs
that run `model.step` on requests. `generate` and the `Engine` drive them (`StaticEngine` through
`generate`).

A state (`DecodeState`) holds rows, the rows of a batch or the engine's slots. Each row is at its
own position (dsv4_jax/model/cache.py). The programs:
- `prefill`: a chunk of prompt tokens into some rows (every row when `rows` is None; the rows
  starting a prompt are reset first). Returns each row's token sampled after its chunk: the
  first token of a row whose prompt ends in it.
- `decode`: one token into every active row, the next one sampled; or in two programs,
  `decode_logits` then `draw`, so that the host can prepare the sampling (a grammar's mask)
  while the model runs.
- `verify`: one draft-then-verify round for every active row (dsv4_jax/runtime/speculative.py);
  1 to k + 1 tokens each.
- `set_history`: a row's penalty history (its prompt's tokens, the counts of those it drew).
- `set_table`: some rows' block tables and reuse points (the rows given blocks since the last).
- `fork`: a row whose prompt was just prefilled copied into other rows, each drawing its own first
  token from the prompt's logits (the choices of an `n` > 1 request: one prefill, n decodes).
The four token programs return `Drawn`: the tokens and, when a row asks, their log-probabilities.
- `decode_loop`, `verify_loop`: `generate`'s whole decode as one program: a `lax.while_loop` over
  the bodies of `decode` and `verify` until every row is done.

Sampling is per row (`Sampling`: temperature and the cut-offs, the logit controls, logprobs). A
row's draws depend on its seed and on how many tokens it has drawn, never on the rows beside it,
so every driver gives a request the same tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.model.cache import fork_rows, put_rows, reset_rows, restore_rows, row_state, save_rows, take_rows
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.deepseek_v4 import DeepseekV4, step
from dsv4_jax.model.mtp import init_mtp_cache
from . import sampling, speculative
from .request import SamplingParams


class DecodeState(NamedTuple):
    """The device state of a set of rows: the cache and, with speculation (k drafts a round), the
    MTP block's cache, the main model's hidden streams at each row's last prompt position so far
    (`carry` `[R, hc, D]`) and the block's rows still to run (`pending`, speculative.Pending); for
    penalties (an engine's state), each row's output token counts (`counts` int32 `[R, V]`, of the
    tokens fed back so far) and its prompt's tokens (`prompt` bool `[R, V]`, `set_history`); for
    forks (an engine's state), each row's logits after the last token of its prompt (`logits`
    fp32 `[R, V]`, set by `prefill` where a prompt ends), which `fork` draws from; for prefix
    caching (an engine's state), `snapshots`: S rows' states saved by `prefill` where a chunk
    ends, for a later row to start from (`{"cache": cache.row_state tree, and with speculation
    "mtp_cache": the same of the MTP block's, "carry": [S, hc, D]}`)."""

    cache: dict
    mtp_cache: dict | None = None
    carry: jnp.ndarray | None = None
    pending: speculative.Pending | None = None
    counts: jnp.ndarray | None = None
    prompt: jnp.ndarray | None = None
    logits: jnp.ndarray | None = None
    snapshots: dict | None = None


class Drawn(NamedTuple):
    """Tokens drawn (`[R]`, or `[R, n]` from a verification) and the model's log-probabilities
    (sampling.logprobs) of each and of the MAX_TOP_LOGPROBS most likely there: zeros when no row
    asked for them."""

    tokens: jnp.ndarray
    logprob: jnp.ndarray
    top_ids: jnp.ndarray
    top_logprobs: jnp.ndarray


class Sampling(NamedTuple):
    """How each row draws its next token: temperature, top_k, top_p and min_p `[R]`
    (`sampling.sample`), its seed (uint32 `[R]`), the tokens it has drawn so far (int32 `[R]`, its
    key's counter and min_tokens' count), its adjustments of the logits (`sampling.Controls`) and
    whether it wants log-probabilities (bool `[R]`)."""

    temperature: jnp.ndarray
    top_k: jnp.ndarray
    top_p: jnp.ndarray
    min_p: jnp.ndarray
    seeds: jnp.ndarray
    drawn: jnp.ndarray
    controls: sampling.Controls
    logprobs: jnp.ndarray

    @classmethod
    def rows(cls, n: int, vocab_size: int, params: Mapping[int, SamplingParams] | None = None,
             drawn: Mapping[int, int] | None = None) -> "Sampling":
        """n rows of a vocab_size-token model, row i drawing as params[i] (seeded with the low 32
        bits of its seed), having drawn drawn[i] tokens; the rows not in params greedy, those not
        in drawn at 0. The grammar masks are every token's (`Controls.mask`: set them after)."""
        c = sampling.Controls.neutral(n, vocab_size)
        s = cls(np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32),
                np.zeros(n, np.uint32), np.zeros(n, np.int32), c, np.zeros(n, bool))
        for i, p in (params or {}).items():
            s.temperature[i], s.top_k[i], s.top_p[i], s.min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            s.seeds[i], s.logprobs[i] = p.seed % 2 ** 32, p.logprobs is not None
            c.presence[i], c.frequency[i], c.repetition[i] = (p.presence_penalty, p.frequency_penalty,
                                                              p.repetition_penalty)
            if p.logit_bias:
                ids, values = zip(*p.logit_bias)
                c.bias_ids[i, :len(ids)], c.bias_values[i, :len(ids)] = ids, values
            if p.min_tokens:
                c.min_tokens[i] = p.min_tokens
                c.stop_ids[i, :len(p.stop_token_ids)] = p.stop_token_ids
        for i, d in (drawn or {}).items():
            s.drawn[i] = d
        return s

    @property
    def params(self) -> tuple:
        return self.temperature, self.top_k, self.top_p, self.min_p

    def keys(self) -> jnp.ndarray:
        return sampling.row_keys(self.seeds, self.drawn)

    def adjusted(self, logits: jnp.ndarray, state: DecodeState | None = None, offset: int = 0) -> jnp.ndarray:
        """Each row's logits fp32 `[R, V]` after its controls (sampling.adjusted), the penalties
        from the state's counts when it has them; offset: tokens drawn since `drawn` (a
        verification's later positions)."""
        counts, prompt = (None, None) if state is None else (state.counts, state.prompt)
        return sampling.adjusted(logits, self.controls, self.drawn + offset, counts, prompt)

    def draw(self, logits: jnp.ndarray, state: DecodeState | None = None) -> Drawn:
        """Each row's token from its logits fp32 `[R, V]`, with the log-probabilities."""
        tokens = sampling.sample(self.adjusted(logits, state), self.keys(), *self.params)
        return Drawn(tokens, *with_logprobs(self.logprobs, logits, tokens))


def with_logprobs(wanted: jnp.ndarray, logits: jnp.ndarray, tokens: jnp.ndarray) -> tuple:
    """sampling.logprobs of tokens `[R, ...]` under the raw logits `[R, ..., V]`, computed only
    when some row wants them (`wanted` bool `[R]`; zeros otherwise)."""
    n = sampling.MAX_TOP_LOGPROBS
    zeros = (jnp.zeros(tokens.shape, jnp.float32), jnp.zeros(tokens.shape + (n,), jnp.int32),
             jnp.zeros(tokens.shape + (n,), jnp.float32))
    return jax.lax.cond(jnp.any(wanted), lambda: sampling.logprobs(logits, tokens, n), lambda: zeros)


def _count_fed(state: DecodeState, tokens: jnp.ndarray, active: jnp.ndarray) -> DecodeState:
    """The state with each active row's fed token `tokens` `[R]` counted (no counts: itself)."""
    if state.counts is None:
        return state
    return state._replace(counts=state.counts.at[jnp.arange(tokens.shape[0]), tokens].add(active.astype(jnp.int32)))


@partial(jax.jit, donate_argnums=(0,))
def set_history(state: DecodeState, row, prompt, counts) -> DecodeState:
    """Row `row`'s penalty history: its prompt's tokens (bool `[V]`) and the counts of the tokens
    it has fed back (int32 `[V]`: zeros for a new request, its tokens but the last after a
    preemption)."""
    return state._replace(prompt=state.prompt.at[row].set(prompt), counts=state.counts.at[row].set(counts))


@partial(jax.jit, donate_argnums=(0,))
def set_table(state: DecodeState, rows, blocks, shared) -> DecodeState:
    """Rows `rows` (int32 `[n]`; a row past the last: padding, not written) of the paged cache's
    block table set to `blocks` (int32 `[n, blocks per row]`) and their reuse points to `shared`
    (int32 `[n]`), in place: a step sends the rows that changed, not the table, which grows with
    max_len."""
    c = state.cache
    return state._replace(cache={**c, "blocks": c["blocks"].at[rows].set(blocks, mode="drop"),
                                 "shared": c["shared"].at[rows].set(shared, mode="drop")})


def new_state(model: DeepseekV4, rows: int, max_len: int, cfg: ModelConfig | None = None, k: int = 0, *,
              block_size: int | None = None, num_blocks: int | None = None, kv_cache_dtype: str = "auto",
              penalties: bool = False, forks: bool = False, snapshots: int = 0) -> DecodeState:
    """An empty state of `rows` rows of up to max_len positions on the model's devices (pools of
    `num_blocks` blocks of `block_size` tokens, entries and ring rows as kv_cache_dtype:
    cache.init_cache); with k drafts a round, rings k slots wider and the MTP block's state
    (speculative.py; its ring as kv_cache_dtype too); with
    penalties, the rows' token counts and prompt tokens; with forks, the rows' prompt logits; with
    snapshots S > 0, room for S saved row states (a multiple of the mesh's row shards).
    Committed to the devices, as every program's output is, so that the first call compiles the
    program the later ones run."""
    cfg = model.config if cfg is None else cfg
    state = DecodeState(model.new_cache(rows, max_len, cfg, lookahead=k, block_size=block_size, num_blocks=num_blocks,
                                        kv_cache_dtype=kv_cache_dtype))
    if k:
        hidden = (rows, k + 1, cfg.hc_mult, cfg.hidden_size)
        with model.on_mesh():
            state = state._replace(
                mtp_cache=init_mtp_cache(cfg, rows, model.dtype, lookahead=k, kv_cache_dtype=kv_cache_dtype),
                carry=jnp.zeros(hidden[:1] + hidden[2:], model.dtype),
                pending=speculative.Pending(jnp.zeros(hidden, model.dtype), jnp.zeros(hidden[:2], jnp.int32),
                                            jnp.zeros((rows,), jnp.int32)))
    if penalties:
        with model.on_mesh():
            state = state._replace(counts=jnp.zeros((rows, cfg.vocab_size), jnp.int32),
                                   prompt=jnp.zeros((rows, cfg.vocab_size), bool))
    if forks:
        with model.on_mesh():
            state = state._replace(logits=jnp.zeros((rows, cfg.vocab_size), jnp.float32))
    if snapshots:
        # The rows' leaves of a cache of S rows (its pools, of S blocks, dropped).
        saved = {"cache": row_state(model.new_cache(snapshots, max_len, cfg, lookahead=k, block_size=block_size,
                                                    num_blocks=snapshots, kv_cache_dtype=kv_cache_dtype))}
        if k:
            with model.on_mesh():
                saved.update(mtp_cache=row_state(init_mtp_cache(cfg, snapshots, model.dtype, lookahead=k,
                                                                kv_cache_dtype=kv_cache_dtype)),
                             carry=jnp.zeros((snapshots,) + state.carry.shape[1:], model.dtype))
        state = state._replace(snapshots=saved)
    return jax.device_put(state, jax.tree.map(lambda x: x.sharding, state))


def _rows(state: DecodeState, at) -> DecodeState:
    """The penalty history of the rows `at` (a slice or int `[R]`), for `Sampling.draw`."""
    if state.counts is None:
        return state
    return state._replace(counts=state.counts[at], prompt=state.prompt[at])


@partial(jax.jit, static_argnums=(9,), donate_argnums=(2,))
def prefill(params, mtp, state: DecodeState, rows, ids, n_valid, start, ends, sample: Sampling, cfg: ModelConfig,
            depth=None, *, restore=None, keep=None):
    """A chunk ids `[R, T]` (n_valid `[R]` real tokens per row) into the state's rows `rows` (int
    `[R]`, run as one sub-batch; None: every row, in place), the rows with a `start` (int32 `[R]`;
    -1: go on where the row is) restarted at that position first: 0 for a new prompt, or a
    position inside a cached prefix whose blocks the row's table names (cache.py, prefix caching).
    With the MTP block `mtp` (speculation), its rows for the chunk run too, and a row whose prompt
    `ends` here (bool `[R]`) gets its first pending row: the hidden streams at its last prompt
    position and the token sampled after it. A state with `logits` keeps those of the rows whose
    prompt ends here (`fork` draws from them). depth (int32 scalar; None: all): the chunk runs the
    first depth layers only, as many as its rows need (`cache.layers_to_run`). With `snapshots`
    (prefix caching; rows given): a row with a `restore` (int32 `[R]`; -1: none) starts from that
    saved state instead (cache.restore_rows: its position, rings, compressor states; with
    speculation the MTP block's row and the carry), and a row with a `keep` (int32 `[R]`; S or
    more: none) has its state after the chunk saved there. Returns (each row's token sampled after
    its chunk, Drawn `[R]`, the state)."""
    whole = rows is None
    at = slice(None) if whole else rows
    restart = None if whole else start >= 0
    sub = state.cache if whole else reset_rows(take_rows(state.cache, rows), restart, start)
    saved = state.snapshots
    if saved is not None:
        sub = restore_rows(sub, restore, saved["cache"])
    p0 = sub["pos"]
    out = step(params, sub, ids, cfg, True, n_valid=n_valid, return_hidden=mtp is not None, rows_in_place=whole,
               depth=depth)
    drawn = sample.draw(out.logits[:, 0], _rows(state, at))
    state = state._replace(cache=out.cache if whole else put_rows(state.cache, rows, out.cache))
    if saved is not None:
        saved = {**saved, "cache": save_rows(saved["cache"], keep, out.cache)}
    if state.logits is not None:
        R = ids.shape[0]
        ending = jnp.where(ends, jnp.arange(R) if whole else rows, state.logits.shape[0])  # the others: dropped
        state = state._replace(logits=state.logits.at[ending].set(out.logits[:, 0], mode="drop"))
    if mtp is not None:
        # The block runs one position behind the model (speculative.prefill_block).
        block = state.mtp_cache if whole else reset_rows(take_rows(state.mtp_cache, rows), restart,
                                                         jnp.maximum(start - 1, 0))
        carry = state.carry[at]
        if saved is not None:
            block = restore_rows(block, restore, saved["mtp_cache"])
            carry = jnp.where((restore >= 0)[:, None, None], saved["carry"][jnp.maximum(restore, 0)], carry)
        block, carry = speculative.prefill_block(mtp, params["embed"], params["head"], block, out.hidden, ids, p0,
                                                 n_valid, carry, cfg)
        state = state._replace(mtp_cache=block if whole else put_rows(state.mtp_cache, rows, block),
                               carry=state.carry.at[at].set(carry),
                               pending=speculative.start(state.pending, at, ends, carry, drawn.tokens))
        if saved is not None:
            saved = {**saved, "mtp_cache": save_rows(saved["mtp_cache"], keep, block),
                     "carry": saved["carry"].at[keep].set(carry, mode="drop")}
    return drawn, state._replace(snapshots=saved)


@partial(jax.jit, donate_argnums=(0,))
def fork(state: DecodeState, src, dst, src_block, dst_block, sample: Sampling) -> tuple[Drawn, DecodeState]:
    """Row src[i] (int32 `[P]`), its prompt just prefilled, copied into row dst[i] (`[P]`; a row
    past the last: padding, nothing written): its position, table, rings and compressor states
    (cache.fork_rows, which also copies pool block src_block[i] into dst_block[i], the block the
    new row writes on into), with speculation the MTP block's row, the carry and the pending row;
    each new row then draws its first token from src[i]'s prompt logits (`logits`) with its own
    sampling `sample` (`[P]`) and penalty history (set before, as for any new request), and that
    token becomes its pending row's. Returns (Drawn `[P]`, the state)."""
    cache = fork_rows(state.cache, src, dst, src_block, dst_block)
    drawn = sample.draw(state.logits[src], _rows(state, dst))  # a padding dst reads a clamped row: unused
    state = state._replace(cache=cache)
    if state.mtp_cache is not None:
        def copy(a):
            return a.at[dst].set(a[src], mode="drop")

        p = state.pending
        ids = copy(p.ids).at[dst, 0].set(drawn.tokens, mode="drop")
        state = state._replace(mtp_cache=fork_rows(state.mtp_cache, src, dst), carry=copy(state.carry),
                               pending=speculative.Pending(copy(p.hidden), ids, copy(p.n)))
    return drawn, state


def _decode(params, cache: dict, tokens, active, sample: Sampling, cfg: ModelConfig):
    out = step(params, cache, tokens[:, None], cfg, True, n_valid=active.astype(jnp.int32))
    return sample.draw(out.logits[:, 0]).tokens, out.cache


def _forward(params, state: DecodeState, tokens, active, cfg: ModelConfig, start, prompt):
    cache = state.cache if start is None else reset_rows(state.cache, start >= 0, start)
    state = _count_fed(state._replace(cache=cache), tokens, active if prompt is None else active & ~prompt)
    out = step(params, state.cache, tokens[:, None], cfg, True, n_valid=active.astype(jnp.int32))
    return out.logits[:, 0], state._replace(cache=out.cache)


@partial(jax.jit, static_argnums=(5,), donate_argnums=(1,))
def decode(params, state: DecodeState, tokens, active, sample: Sampling, cfg: ModelConfig, start=None, prompt=None):
    """Each row's last token `tokens` `[R]` into every `active` row (bool `[R]`; the others hold),
    counted in the penalty history. A prompt fed one token a step (the engine's deterministic
    mode) also gives `start` (int32 `[R]`: a row starting its prompt restarts there first; -1:
    goes on) and `prompt` (bool `[R]`: the rows fed a prompt token, not counted). Returns (the
    next token of each row, Drawn `[R]`, the state)."""
    logits, state = _forward(params, state, tokens, active, cfg, start, prompt)
    return sample.draw(logits, state), state


@partial(jax.jit, static_argnums=(4,), donate_argnums=(1,))
def decode_logits(params, state: DecodeState, tokens, active, cfg: ModelConfig, start=None, prompt=None):
    """`decode`'s first half, for rows whose sampling needs the host meanwhile (a grammar's
    mask, filled while this runs): (each row's logits fp32 `[R, V]`, the state); `draw` then
    samples."""
    return _forward(params, state, tokens, active, cfg, start, prompt)


@jax.jit
def draw(logits, counts, prompt, sample: Sampling) -> Drawn:
    """`decode`'s second half: each row's token from `decode_logits`' logits, with the state's
    penalty history (`counts`, `prompt`; None: none), Drawn `[R]`."""
    return sample.draw(logits, DecodeState({}, counts=counts, prompt=prompt))


@partial(jax.jit, static_argnums=(7, 8), donate_argnums=(2,))
def verify(params, drafter, state: DecodeState, last, active, limit, sample: Sampling, k: int, cfg: ModelConfig):
    """One round of speculation (speculative.verify_round) for every active row, from its last token
    `last` `[R]` (counted in the penalty history), keeping at most limit[r] of the k drafts that
    `drafter` gives. Returns (each row's tokens, Drawn `[R, k + 1]` (the first kept + 1 are real),
    kept `[R]`, the state)."""
    state = _count_fed(state, last, active)
    state, tokens, kept, logits = speculative.verify_round(params, drafter, state, last, active, limit, sample, k,
                                                           cfg)
    return Drawn(tokens, *with_logprobs(sample.logprobs, logits, tokens)), kept, state


def _stops(tokens: jnp.ndarray, eos: jnp.ndarray) -> jnp.ndarray:
    """Whether each token (`[B]`, or `[B, n]`) is one of its row's stop ids, eos int32 `[B, K]`
    (-1: none; `[K]`: the same ids for every row)."""
    if tokens.ndim == 2:
        eos = jnp.expand_dims(eos, -2)  # each row's ids against each of its n tokens
    return jnp.any(tokens[..., None] == eos, axis=-1)


def _first(state: DecodeState, first, buf, done, max_new, eos):
    """Each row's first token (from the prefill) into buf at its position; (buf, n_gen, done)."""
    rows = jnp.arange(buf.shape[0])
    buf = buf.at[rows, jnp.where(done, buf.shape[1], state.cache["pos"])].set(first, mode="drop")
    n_gen = (~done).astype(jnp.int32)
    return buf, n_gen, done | _stops(first, eos) | (n_gen >= max_new)


@partial(jax.jit, static_argnums=(8,), donate_argnums=(1,))
def decode_loop(params, state: DecodeState, first, buf, done, max_new, sample: Sampling, eos, cfg: ModelConfig):
    """`generate`'s decode: from each row's first token `first` `[B]` (sampled by `prefill`), feeds
    each token back and samples the next until every row is done, at one of its stop ids `eos`
    int32 `[B, K]` (-1: none; `[K]`: the same for every row) or after its max_new tokens (int32
    `[B]`, or one for every row).

    buf int32 `[B, max_len]` holds the prompts and receives each row's tokens at their positions;
    done bool `[B]`: rows that take no part (batch padding). Returns (buf, tokens generated per
    row, the state)."""
    rows = jnp.arange(buf.shape[0])
    buf, n_gen, done = _first(state, first, buf, done, max_new, eos)

    def body(s):
        cache, tok, buf, n_gen, done = s
        tok, cache = _decode(params, cache, tok, ~done, sample._replace(drawn=n_gen), cfg)
        tok = jnp.where(done, 0, tok)
        buf = buf.at[rows, jnp.where(done, buf.shape[1], cache["pos"])].set(tok, mode="drop")
        n_gen = n_gen + ~done
        done = done | _stops(tok, eos) | (n_gen >= max_new)
        return cache, tok, buf, n_gen, done

    cache, _, buf, n_gen, _ = jax.lax.while_loop(lambda s: ~jnp.all(s[4]), body,
                                                 (state.cache, first, buf, n_gen, done))
    return buf, n_gen, state._replace(cache=cache)  # returned so that the donated buffers alias it


@partial(jax.jit, static_argnums=(10, 11), donate_argnums=(2,))
def verify_loop(params, drafter, state: DecodeState, first, buf, done, max_new, sample: Sampling, eos, limit,
                k: int, cfg: ModelConfig):
    """`decode_loop` with speculation: `verify` rounds (k drafts from `drafter`, row r proposing
    the first limit[r] of them, int32 `[B]`) until every row is done. Returns (buf, tokens
    generated per row, the counters: "rounds" (main-model steps), the
    speculative.SPEC_DECODE_COUNTERS, and "accepted_per_position" `[k]` (drafts whose i-th token
    was kept), the state)."""
    max_len = buf.shape[1]
    rows = jnp.arange(buf.shape[0])[:, None]
    buf, n_gen, done = _first(state, first, buf, done, max_new, eos)
    counters = {"rounds": jnp.int32(0), **dict.fromkeys(speculative.SPEC_DECODE_COUNTERS, jnp.int32(0)),
                "accepted_per_position": jnp.zeros((k,), jnp.int32)}
    i = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

    def body(s):
        state, last, buf, n_gen, done, counters = s
        active = ~done
        q = state.cache["pos"]
        state, tokens, kept, _ = speculative.verify_round(params, drafter, state, last, active, limit,
                                                          sample._replace(drawn=n_gen), k, cfg)
        emit = jnp.where(active, jnp.minimum(kept + 1, max_new - n_gen), 0)  # the real tokens, within the limit
        stop = _stops(tokens, eos) & (i < emit[:, None])
        emit = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, emit)  # through the first stop id
        buf = buf.at[rows, jnp.where(i < emit[:, None], q[:, None] + 1 + i, max_len)].set(tokens, mode="drop")
        n_gen = n_gen + emit
        done = done | jnp.any(stop, axis=1) | (n_gen >= max_new)
        last = jnp.take_along_axis(tokens, kept[:, None], axis=1)[:, 0]
        n_active = jnp.sum(active, dtype=jnp.int32)
        added = (n_active, jnp.sum(jnp.where(active, limit, 0)), jnp.sum(jnp.where(active, kept, 0)))
        counters = {"rounds": counters["rounds"] + 1,
                    **{name: counters[name] + n for name, n in zip(speculative.SPEC_DECODE_COUNTERS, added)},
                    "accepted_per_position": counters["accepted_per_position"]
                    + jnp.sum((jnp.arange(k)[None, :] < kept[:, None]) & active[:, None], axis=0, dtype=jnp.int32)}
        return state, last, buf, n_gen, done, counters

    state, _, buf, n_gen, _, counters = jax.lax.while_loop(lambda s: ~jnp.all(s[4]), body,
                                                           (state, first, buf, n_gen, done, counters))
    return buf, n_gen, counters, state
