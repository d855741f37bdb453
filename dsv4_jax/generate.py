"""`generate`: chunked prefill, then a decode loop inside one `jax.jit` (`lax.while_loop`) over a
donated cache.

Every shape the compiled programs see comes from a bucket, so requests of nearby sizes reuse
them: the batch is padded to 1, 2, 4 or 8 rows, then a multiple of 8 (the extra rows are done
from the start); the cache and the decode loop's token buffer hold max_len tokens, by default
the first of 128 x (1, 2, 3, 4, 6, 8, 12, 16, ...) that fits the longest prompt plus
max_new_tokens; the prompts' common prefix, rounded down to a multiple of MIN_PREFILL_CHUNK
tokens, is prefilled in chunks of 512 tokens and powers of two down to MIN_PREFILL_CHUNK. So a
(batch, max_len) bucket compiles one decode loop and at most six prefill chunk programs, each
once.

A batch shares one position counter. The prompt tokens past the prefill (the common prefix's
last few, and each longer row's rest) are fed through the decode loop one step at a time as
forced tokens (their logits are not sampled). In fp32 a decode step and a prefill chunk compute
the same logits to about 1e-6, so a row of a batch gives the greedy tokens it gives alone; in
bf16 the different grouping rounds differently and rows can diverge after a few tokens.
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

from .cache import init_cache
from .config import ModelConfig
from .layer_weights import unstack_layers
from .model import RUNTIME_OPTIONS, Model, step, with_options

PREFILL_CHUNK = 512
MIN_PREFILL_CHUNK = 16
EOS_SLOTS = 8


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens int32 `[B, max_new_tokens]` (row b's first lengths[b] are generated, the rest 0);
    lengths int32 `[B]` (an eos token, when produced, is included)."""

    tokens: np.ndarray
    lengths: np.ndarray

    def rows(self) -> list[list[int]]:
        return [list(map(int, t[:n])) for t, n in zip(self.tokens, self.lengths)]


def batch_bucket(rows: int) -> int:
    """Rows the compiled programs hold for a batch of `rows`: 1, 2, 4, 8, then multiples of 8."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


def length_bucket(tokens: int) -> int:
    """The default cache length for `tokens`: the first of 128 x (1, 2, 3, 4, 6, 8, 12, ...) that
    holds them (at most 1.5x what they need beyond 256)."""
    units, b = -(-tokens // 128), 1
    while True:
        if b >= units:
            return 128 * b
        if b >= 2 and b * 3 // 2 >= units:
            return 128 * (b * 3 // 2)
        b *= 2


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
                     eos_token_id=None, seed=0, max_len=None) -> Request:
    """`generate`'s arguments checked against the model, before anything compiles: ValueError
    for a bad value, TypeError for a bad type, each naming the argument."""
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
    longest = max(map(len, rows))
    need = longest + max_new_tokens
    if max_len is None:
        if need > limit:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                             f"model's max_position_embeddings ({limit})")
        max_len = min(length_bucket(need), limit)
    else:
        max_len = _integer(max_len, "max_len")
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_len must be between 1 and the model's max_position_embeddings ({limit}), "
                             f"got {max_len}")
        if longest > max_len:
            raise ValueError(f"a prompt of {longest} tokens is longer than max_len={max_len}")
        if need > max_len:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                             f"max_len={max_len}")
    return Request(rows, max_new_tokens, t, top_k, p, eos, seed, max_len)


def sample_logits(logits: jnp.ndarray, key: jax.Array, temperature, top_k, top_p) -> jnp.ndarray:
    """Next tokens `[B]` from fp32 logits `[B, V]`: argmax at temperature 0 (ties: lowest id),
    else a draw from softmax(logits / temperature) restricted to the top_k most likely tokens
    (0: all) and to the smallest set whose probability reaches top_p (the most likely token is
    always kept). All three are traced values: changing them does not recompile."""
    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():  # the sort and the draw only run when sampling
        scaled = logits / jnp.maximum(temperature, 1e-6)
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
        V = logits.shape[-1]
        kth = jnp.take_along_axis(ordered, jnp.clip(jnp.where(top_k > 0, top_k, V) - 1, 0, V - 1)
                                  * jnp.ones((logits.shape[0], 1), jnp.int32), axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly above each token
        keep_sorted = (before < top_p) & (ordered >= kth)
        cutoff = jnp.min(jnp.where(keep_sorted, ordered, jnp.inf), axis=-1, keepdims=True)
        masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
        return jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, greedy)


@partial(jax.jit, static_argnums=(3, 4), donate_argnums=(1,))
def _prefill(params, cache, ids, cfg, last_only):
    return step(params, cache, ids, cfg, last_only)


@partial(jax.jit, static_argnums=(8,), donate_argnums=(1,))
def _decode_loop(params, cache, logits, buf, lengths, done, max_new, key, cfg, temperature, top_k, top_p, eos):
    """Feeds one token per row per iteration until every row is done or the buffer is full.

    params: as `unstack_layers` gives them (on CPU: the large layer weights split per layer,
    once per generate call, outside this program). logits fp32 `[B, V]`: the prefill's last
    position (read only when a row samples at the cache's position). buf int32 `[B, total]`
    holds the prompts and receives the generated tokens; lengths int32 `[B]` the prompts'
    lengths; done bool `[B]` the rows that take no part (batch padding); eos int32 `[K]` the
    stop ids (-1: none). Returns (buf, tokens generated per row, the cache)."""
    B, total = buf.shape

    def cond(s):
        cache, _, _, _, done, _ = s
        return (cache["pos"][0] < total) & ~jnp.all(done)

    def body(s):
        cache, logits, buf, n_gen, done, key = s
        p = cache["pos"][0]
        key, sub = jax.random.split(key)
        forced = p < lengths
        tok = jnp.where(forced, buf[:, p], sample_logits(logits, sub, temperature, top_k, top_p))
        generating = ~forced & ~done
        tok = jnp.where(done, 0, tok)
        buf = buf.at[:, p].set(tok)
        n_gen = n_gen + generating
        stop = jnp.any(tok[:, None] == eos[None, :], axis=-1)
        done = done | (generating & stop) | (n_gen >= max_new)
        logits, cache = step(params, cache, tok[:, None], cfg, True)
        return cache, logits[:, 0], buf, n_gen, done, key

    n_gen = jnp.zeros((B,), jnp.int32)
    state = (cache, logits, buf, n_gen, done, key)
    cache, _, buf, n_gen, _, _ = jax.lax.while_loop(cond, body, state)
    return buf, n_gen, cache  # the cache is returned so that the donated input buffers alias it


def prefill_chunks(length: int, chunk: int = PREFILL_CHUNK) -> list[int]:
    """Chunk sizes covering `length` tokens: full chunks, then powers of two, so a handful of
    compiled shapes serve every length."""
    sizes = [chunk] * (length // chunk)
    rest = length % chunk
    bit = 1 << max(rest.bit_length() - 1, 0)
    while rest:
        if rest >= bit:
            sizes.append(bit)
            rest -= bit
        bit >>= 1
    return sizes


def _eos_ids(eos: tuple[int, ...]) -> jnp.ndarray:
    """The stop ids as int32 `[K]`, K = EOS_SLOTS or the next power of two above it (padded
    with -1, which no token equals), so that none, one or a few ids share the compiled loop."""
    k = max(EOS_SLOTS, 1 << max(len(eos) - 1, 0).bit_length())
    return jnp.asarray(list(eos) + [-1] * (k - len(eos)), jnp.int32)


_PARAMETERS = ("model", "prompts", "max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id", "seed",
               "max_len")


def generate(model: Model, prompts: Sequence[Sequence[int]] | np.ndarray, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | Sequence[int] | None = None, seed: int = 0, max_len: int | None = None,
             **options) -> GenerateOutput:
    """Continues each prompt by up to max_new_tokens tokens.

    prompts: a list of token-id lists (ragged; a row may be a 1-D integer array) or an int array
    `[B, S]`. Greedy at temperature 0, else sampling with top_k (0: off, at most the vocabulary)
    / top_p; a row stops at eos_token_id (one id, or a list: any of them). max_len sizes the
    cache (default: the longest prompt plus max_new_tokens, rounded up to a bucket; see the
    module docstring). Invalid input raises ValueError (TypeError for a wrong type or an unknown
    keyword) before anything compiles. `options` override the model's run-time options for this
    call (e.g. use_index_cache=True, index_topk_freq=2; see `load`).
    """
    unknown = sorted(set(options) - set(RUNTIME_OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _PARAMETERS + RUNTIME_OPTIONS, n=1)
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else ""))
    cfg = with_options(model.config, **options)
    req = validate_request(prompts, cfg, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, max_len)
    B, Bb = len(req.rows), batch_bucket(len(req.rows))
    common = min(map(len, req.rows))
    lengths = np.full((Bb,), common, np.int32)  # the padding rows: done from the start
    buf = np.zeros((Bb, req.max_len), np.int32)
    for b, r in enumerate(req.rows):
        lengths[b] = len(r)
        buf[b, : len(r)] = r

    params = unstack_layers(model.params)
    cache = init_cache(cfg, Bb, req.max_len, model.dtype)
    logits = jnp.zeros((Bb, cfg.vocab_size), jnp.float32)  # unread without a prefill: every row is forced first
    pos = 0
    for size in prefill_chunks(common - common % MIN_PREFILL_CHUNK):
        last, cache = _prefill(params, cache, jnp.asarray(buf[:, pos: pos + size]), cfg, True)
        logits = last[:, 0]
        pos += size
    out, n_gen, _ = _decode_loop(
        params, cache, logits, jnp.asarray(buf), jnp.asarray(lengths), jnp.asarray(np.arange(Bb) >= B),
        jnp.int32(req.max_new_tokens), jax.random.PRNGKey(req.seed), cfg, jnp.float32(req.temperature),
        jnp.int32(req.top_k), jnp.float32(req.top_p), _eos_ids(req.eos))
    out, n_gen = np.asarray(out), np.asarray(n_gen)
    tokens = np.zeros((B, req.max_new_tokens), np.int32)
    for b in range(B):
        tokens[b, : n_gen[b]] = out[b, lengths[b]: lengths[b] + n_gen[b]]
    return GenerateOutput(tokens=tokens, lengths=n_gen[:B].astype(np.int32))
