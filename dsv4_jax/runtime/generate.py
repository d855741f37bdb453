"""`generate`: every row's prompt prefilled in chunks, then a decode loop inside one `jax.jit`
(`lax.while_loop`) over a donated cache: the programs of dsv4_jax/runtime/decode.py.

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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.deepseek_v4 import RUNTIME_OPTIONS, Model, with_options
from dsv4_jax.model.layer_weights import unstack_layers
from . import decode, speculative
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


def run_request(model: Model, cfg: ModelConfig, req: Request, drafter=None) -> GenerateOutput:
    """`generate` on a checked request, through the programs of dsv4_jax/runtime/decode.py.
    drafter (speculation only): the draft source (default: the model's MTP block,
    `speculative.BlockDrafts`; a test's or a benchmark's may draft from a known continuation)."""
    B, Bb = len(req.rows), model.batch_rows(batch_bucket(len(req.rows)))
    lengths = np.zeros((Bb,), np.int32)  # the padding rows: no prompt, done from the start
    buf = np.zeros((Bb, req.max_len), np.int32)
    for b, r in enumerate(req.rows):
        lengths[b] = len(r)
        buf[b, : len(r)] = r
    params = unstack_layers(model.params)
    sample = decode.Sampling.rows(Bb, req.temperature, req.top_k, req.top_p, (req.seed + np.arange(Bb)) % 2 ** 32)
    done, max_new, eos = np.arange(Bb) >= B, np.int32(req.max_new_tokens), _eos_ids(req.eos)
    k = req.speculative_tokens
    mtp = model.mtp.params if k else None
    state = decode.new_state(model, Bb, req.max_len, cfg, k)
    with model.on_mesh():
        first = jnp.zeros((Bb,), jnp.int32)  # each row's first token, from the chunk its prompt ends in
        for ids, n, ends in prefill_chunks(buf, lengths, PREFILL_CHUNK):
            tokens, state = decode.prefill(params, mtp, state, None, ids, n, None, ends, sample, cfg)
            first = jnp.where(ends, tokens, first)
        counters = None
        if k:
            drafter = (speculative.BlockDrafts(mtp) if drafter is None else drafter).for_rows(Bb)
            out, n_gen, counters, _ = decode.verify_loop(params, drafter, state, first, buf, done, max_new, sample,
                                                         eos, k, cfg)
        else:
            out, n_gen, _ = decode.decode_loop(params, state, first, buf, done, max_new, sample, eos, cfg)
        out, n_gen = (np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (out, n_gen))
    tokens = np.zeros((B, req.max_new_tokens), np.int32)
    for b in range(B):
        tokens[b, : n_gen[b]] = out[b, lengths[b]: lengths[b] + n_gen[b]]
    return GenerateOutput(tokens=tokens, lengths=n_gen[:B].astype(np.int32),
                          speculation=None if counters is None else speculation_stats(counters))


def speculation_stats(counters: dict) -> dict:
    """A speculative run's counters (`decode.verify_loop`) by the names the engine and the server
    use (speculative.SPEC_DECODE_COUNTERS, `accepted_at(i)`), with "rounds" (main-model steps) and
    the acceptance figures (`speculative.acceptance`)."""
    c = {k: np.asarray(v).tolist() for k, v in counters.items()}
    c.update({speculative.accepted_at(i): n for i, n in enumerate(c.pop("accepted_per_position"))})
    return {**c, **speculative.acceptance(*(c[name] for name in speculative.SPEC_DECODE_COUNTERS))}
