"""`generate`: every row's prompt prefilled in chunks, then a decode loop inside one `jax.jit`
(`lax.while_loop`) over a donated cache.

Every row has its own position in the cache (dsv4_jax/model/cache.py), so a ragged batch prefills each
row's own prompt: chunk k holds tokens k*C .. (k+1)*C - 1 of every row (C = PREFILL_CHUNK), a row
whose prompt has ended holds its state (its part of the chunk is padding), and the last chunk is
cut to the power of two (from MIN_PREFILL_CHUNK) that holds the longest rest. A row's prompt is
thus cut where it would be cut alone, and each row then decodes from its own position; the
rows of a batch compute what they compute alone, the same operations in another batch shape
(fp32: logits equal to about 1e-6, the same greedy tokens; bf16 rounds each product of a batch
like the lone one's as long as XLA picks the same kernels).

Every shape the compiled programs see comes from a bucket, so requests of nearby sizes reuse
them: the batch is padded to 1, 2, 4 or 8 rows, then a multiple of 8 (and of the devices the
model's mesh splits sequences over; the extra rows are done from the start); the cache and the
decode loop's token buffer hold max_len tokens, by default the first of 128 x (1, 2, 3, 4, 6, 8,
12, 16, ...) that fits the longest prompt plus max_new_tokens. So a (batch, max_len) bucket
compiles one decode loop and at most six prefill chunk programs, each once.

Sampling draws row b with the seed `seed + b` (dsv4_jax/runtime/sampling.py): a row's draws do not
depend on the rows beside it, and a one-prompt call gives what the serving engine gives for
that prompt with that seed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.deepseek_v4 import RUNTIME_OPTIONS, Model, step, with_options
from dsv4_jax.model.layer_weights import unstack_layers
from . import sampling, speculative
from .buckets import PREFILL_CHUNK, batch_bucket, length_bucket, prefill_chunks

EOS_SLOTS = 8
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens int32 `[B, max_new_tokens]` (row b's first lengths[b] are generated, the rest 0);
    lengths int32 `[B]` (an eos token, when produced, is included); speculation: with
    speculative_tokens, the counters of `speculation_stats`, else None."""

    tokens: np.ndarray
    lengths: np.ndarray
    speculation: dict | None = None

    def rows(self) -> list[list[int]]:
        return [list(map(int, t[:n])) for t, n in zip(self.tokens, self.lengths)]


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked `generate` request (validate_request)."""

    rows: list[list[int]]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    eos: tuple[int, ...]  # () for none
    seed: int
    max_len: int
    speculative_tokens: int = 0


def _is_integer(x) -> bool:
    """A Python / numpy integer or a 0-d integer array (not a bool)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (np.ndarray, jax.Array)):
        return x.ndim == 0 and np.issubdtype(x.dtype, np.integer)
    return isinstance(x, (int, np.integer))


def _integer(x, name: str) -> int:
    if not _is_integer(x):
        raise TypeError(f"{name} must be an integer, got {x!r}")
    return int(x)


def _real(x, name: str) -> float:
    """A Python / numpy number or a 0-d int / float array (not a bool) as a float."""
    if isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 and not np.issubdtype(x.dtype, np.bool_) and (
            np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        return float(x)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {x!r}")
    return float(x)


def _prompt_rows(prompts) -> list[list[int]]:
    """prompts as lists of Python ints: an integer array `[B, S]`, or a list / tuple of rows,
    each a list / tuple of integers or a 1-D integer array."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2 or not np.issubdtype(prompts.dtype, np.integer):
            raise TypeError(f"prompts must be an integer array [B, S] or a list of token-id lists, got "
                            f"{prompts.dtype}{list(prompts.shape)}")
        return np.asarray(prompts).tolist()
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists or an integer array [B, S], got "
                        f"{type(prompts).__name__}")
    rows = []
    for b, r in enumerate(prompts):
        if isinstance(r, (np.ndarray, jax.Array)) and r.ndim == 1 and np.issubdtype(r.dtype, np.integer):
            rows.append(np.asarray(r).tolist())
            continue
        if _is_integer(r):
            raise TypeError(f"prompts must be a list of prompts, each a list of token ids; got a flat list of "
                            f"integers (one prompt is [[{r!r}, ...]])")
        if not isinstance(r, (list, tuple)):
            raise TypeError(f"prompt {b} must be a list of token ids or a 1-D integer array, got {r!r}")
        for t in r:
            if not _is_integer(t):
                raise TypeError(f"prompt {b} holds a non-integer token {t!r}")
        rows.append([int(t) for t in r])
    return rows


def validate_request(prompts, cfg: ModelConfig, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0,
                     eos_token_id=None, seed=0, max_len=None, speculative_tokens=0) -> Request:
    """`generate`'s arguments checked against the model, before anything compiles: ValueError
    for a bad value, TypeError for a bad type, each naming the argument. With speculative_tokens
    k, the cache holds k positions more (a verification writes k past the last token it keeps)."""
    rows = _prompt_rows(prompts)
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    V, limit = cfg.vocab_size, cfg.max_position_embeddings
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        bad = next((t for t in r if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"prompt {b} holds token id {bad} outside the vocabulary [0, {V})")
    max_new_tokens = _integer(max_new_tokens, "max_new_tokens")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    t = _real(temperature, "temperature")
    if not (math.isfinite(t) and 0 <= t <= float(np.finfo(np.float32).max)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    top_k = _integer(top_k, "top_k")
    if not 0 <= top_k <= V:
        raise ValueError(f"top_k must be between 0 (no top-k) and the vocabulary size {V}, got {top_k}")
    p = _real(top_p, "top_p")
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if eos_token_id is None:
        eos = ()
    else:
        many = isinstance(eos_token_id, (list, tuple))
        eos = tuple(_integer(e, "eos_token_id") for e in (eos_token_id if many else [eos_token_id]))
        if not eos or any(not 0 <= e < V for e in eos):
            raise ValueError(f"eos_token_id must be a token id in [0, {V}), a non-empty list of them, or None, "
                             f"got {eos_token_id!r}")
    seed = _integer(seed, "seed")
    if not -(2 ** 63) <= seed < 2 ** 63:
        raise ValueError(f"seed must fit in 64 bits, got {seed}")
    k = _integer(speculative_tokens, "speculative_tokens")
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_tokens must be between 0 (off) and {MAX_SPECULATIVE_TOKENS}, got {k}")
    longest = max(map(len, rows))
    need = longest + max_new_tokens + k
    if max_len is None:
        if need > limit:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens})"
                             + (f" + speculative_tokens ({k})" if k else "")
                             + f" = {need} exceeds the model's max_position_embeddings ({limit})")
        max_len = min(length_bucket(need), limit)
    else:
        max_len = _integer(max_len, "max_len")
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_len must be between 1 and the model's max_position_embeddings ({limit}), "
                             f"got {max_len}")
        if longest > max_len:
            raise ValueError(f"a prompt of {longest} tokens is longer than max_len={max_len}")
        if need > max_len:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens})"
                             + (f" + speculative_tokens ({k})" if k else "") + f" = {need} exceeds max_len={max_len}")
    return Request(rows, max_new_tokens, t, top_k, p, eos, seed, max_len, k)


@partial(jax.jit, static_argnums=(6,), donate_argnums=(1,))
def _prefill(params, cache, ids, n_valid, ends, logits, cfg):
    """A chunk ids `[B, T]` (n_valid `[B]` real tokens per row) into the cache. logits fp32 `[B, V]`:
    each row's logits after its last prompt token so far, replaced for the rows whose prompt
    `ends` (bool `[B]`) in this chunk. Returns (logits, cache)."""
    last, cache = step(params, cache, ids, cfg, True, n_valid=n_valid)
    return jnp.where(ends[:, None], last[:, 0], logits), cache


@partial(jax.jit, static_argnums=(9,), donate_argnums=(1,))
def _decode_loop(params, cache, logits, buf, done, max_new, seeds, sampling_params, eos, cfg):
    """Samples a token per row from `logits` fp32 `[B, V]` and feeds it back, until every row is
    done: at one of the stop ids `eos` int32 `[K]` (-1: none) or after max_new tokens.

    params: as `unstack_layers` gives them (on CPU: the large layer weights split per layer,
    once per generate call, outside this program). buf int32 `[B, max_len]` holds the prompts
    and receives each row's tokens at its positions (the cache's `pos`); done bool `[B]`: rows
    that take no part (batch padding); seeds uint32 `[B]`; sampling_params (temperature, top_k,
    top_p). Returns (buf, tokens generated per row, the cache)."""
    B = buf.shape[0]
    rows = jnp.arange(B)

    def body(s):
        cache, logits, buf, n_gen, done = s
        tok = sampling.sample(logits, sampling.row_keys(seeds, n_gen), *sampling_params)
        tok = jnp.where(done, 0, tok)
        buf = buf.at[rows, jnp.where(done, buf.shape[1], cache["pos"])].set(tok, mode="drop")
        n_gen = n_gen + ~done
        done = done | jnp.any(tok[:, None] == eos[None, :], axis=-1) | (n_gen >= max_new)
        logits, cache = step(params, cache, tok[:, None], cfg, True, n_valid=(~done).astype(jnp.int32))
        return cache, logits[:, 0], buf, n_gen, done

    state = (cache, logits, buf, jnp.zeros((B,), jnp.int32), done)
    cache, _, buf, n_gen, _ = jax.lax.while_loop(lambda s: ~jnp.all(s[4]), body, state)
    return buf, n_gen, cache  # the cache is returned so that the donated input buffers alias it


def prefill(model: Model, params: dict, cfg: ModelConfig, prompts: np.ndarray, lengths: np.ndarray, max_len: int,
            chunk: int = PREFILL_CHUNK):
    """Every row's prompt (`prompts` int32 `[B, >= max(lengths)]`) into a new cache of max_len on the
    model's devices. Returns (each row's logits after its last prompt token fp32 `[B, V]`, the cache)."""
    B = len(lengths)
    with model.on_mesh():
        cache = model.new_cache(B, max_len, cfg)
        logits = jnp.zeros((B, cfg.vocab_size), jnp.float32)
        for ids, n, ends in prefill_chunks(prompts, lengths, chunk):
            logits, cache = _prefill(params, cache, ids, n, ends, logits, cfg)
    return logits, cache


def _eos_ids(eos: tuple[int, ...]) -> np.ndarray:
    """The stop ids as int32 `[K]`, K = EOS_SLOTS or the next power of two above it (padded
    with -1, which no token equals), so that none, one or a few ids share the compiled loop."""
    k = max(EOS_SLOTS, 1 << max(len(eos) - 1, 0).bit_length())
    return np.asarray(list(eos) + [-1] * (k - len(eos)), np.int32)


_PARAMETERS = ("model", "prompts", "max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id", "seed",
               "max_len", "speculative_tokens")


def generate(model: Model, prompts: Sequence[Sequence[int]] | np.ndarray, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | Sequence[int] | None = None, seed: int = 0, max_len: int | None = None,
             speculative_tokens: int = 0, **options) -> GenerateOutput:
    """Continues each prompt by up to max_new_tokens tokens.

    prompts: a list of token-id lists (ragged; a row may be a 1-D integer array) or an int array
    `[B, S]`. Greedy at temperature 0, else sampling with top_k (0: off, at most the vocabulary)
    / top_p; a row stops at eos_token_id (one id, or a list: any of them). max_len sizes the
    cache (default: the longest prompt plus max_new_tokens, rounded up to a bucket; see the
    module docstring). speculative_tokens k > 0 decodes with k drafts a round from the
    checkpoint's MTP block (`load(..., mtp=True)`; dsv4_jax/runtime/speculative.py): greedy output is the
    same, sampled output has the same distribution, and `speculation` says what was accepted.
    Invalid input raises ValueError (TypeError for a wrong type or an unknown keyword) before
    anything compiles. `options` override the model's run-time options for this call (e.g.
    use_index_cache=True, index_topk_freq=2; see `load`).
    """
    unknown = sorted(set(options) - set(RUNTIME_OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _PARAMETERS + RUNTIME_OPTIONS, n=1)
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else ""))
    cfg = with_options(model.config, **options)
    req = validate_request(prompts, cfg, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, max_len,
                           speculative_tokens)
    if req.speculative_tokens and model.mtp is None:
        raise ValueError("speculative_tokens needs the checkpoint's MTP block: load the model with "
                         "dsv4_jax.load(path, mtp=True)")
    return run_request(model, cfg, req)


def run_request(model: Model, cfg: ModelConfig, req: Request, forced=None) -> GenerateOutput:
    """`generate` on a checked request. forced (speculation only): drafts from a known
    continuation instead of the block (`speculative.Forced`, padded to the request's rows)."""
    B, Bb = len(req.rows), model.batch_rows(batch_bucket(len(req.rows)))
    lengths = np.zeros((Bb,), np.int32)  # the padding rows: no prompt, done from the start
    buf = np.zeros((Bb, req.max_len), np.int32)
    for b, r in enumerate(req.rows):
        lengths[b] = len(r)
        buf[b, : len(r)] = r
    params = unstack_layers(model.params)
    seeds = ((req.seed + np.arange(Bb)) % 2 ** 32).astype(np.uint32)
    sampling_params = (np.float32(req.temperature), np.int32(req.top_k), np.float32(req.top_p))
    done, max_new, eos = np.arange(Bb) >= B, np.int32(req.max_new_tokens), _eos_ids(req.eos)
    k, counters = req.speculative_tokens, None
    if k:
        if forced is not None:  # the padding rows draft anything
            forced = speculative.Forced(*(np.pad(np.asarray(a), [(0, Bb - B)] + [(0, 0)] * (np.ndim(a) - 1))
                                          for a in forced))

        logits, cache, mtp_cache, carry = speculative.prefill(model, params, cfg, buf, lengths, req.max_len, k)
        with model.on_mesh():
            out, n_gen, counters, _, _ = speculative.decode_loop(params, model.mtp, cache, mtp_cache, logits, carry,
                                                                 buf, done, max_new, seeds, sampling_params, eos, k,
                                                                 cfg, forced)
    else:
        logits, cache = prefill(model, params, cfg, buf, lengths, req.max_len, PREFILL_CHUNK)
        with model.on_mesh():
            out, n_gen, _ = _decode_loop(params, cache, logits, buf, done, max_new, seeds, sampling_params, eos, cfg)
    with model.on_mesh():
        out, n_gen = (np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (out, n_gen))
    tokens = np.zeros((B, req.max_new_tokens), np.int32)
    for b in range(B):
        tokens[b, : n_gen[b]] = out[b, lengths[b]: lengths[b] + n_gen[b]]
    return GenerateOutput(tokens=tokens, lengths=n_gen[:B].astype(np.int32),
                          speculation=None if counters is None else speculation_stats(counters))


def speculation_stats(counters: dict) -> dict:
    """A speculative run's counters (`speculative.decode_loop`) with the acceptance figures:
    acceptance_rate = accepted / draft tokens, acceptance_length = 1 + accepted / drafts (tokens
    per main-model step of a row), accepted_per_position[i] = drafts whose draft i was kept."""
    c = {k: np.asarray(v).tolist() for k, v in counters.items()}
    c["acceptance_rate"] = c["accepted_tokens"] / max(c["draft_tokens"], 1)
    c["acceptance_length"] = 1 + c["accepted_tokens"] / max(c["drafts"], 1)
    return c
