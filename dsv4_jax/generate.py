"""`generate`: chunked prefill, then a decode loop inside one `jax.jit` (`lax.while_loop`) over a
donated cache.

A ragged batch shares one position counter: the rows' common prefix is prefilled together, and
each longer row's remaining prompt tokens are fed through the decode loop as forced tokens
(their logits are not sampled), so every row computes exactly what it would alone.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache import init_cache
from .config import ModelConfig
from .layer_weights import unstack_layers
from .model import Model, step, with_options

PREFILL_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens int32 `[B, max_new_tokens]` (row b's first lengths[b] are generated, the rest 0);
    lengths int32 `[B]` (an eos token, when produced, is included)."""

    tokens: np.ndarray
    lengths: np.ndarray

    def rows(self) -> list[list[int]]:
        return [list(map(int, t[:n])) for t, n in zip(self.tokens, self.lengths)]


def _validate(prompts, cfg: ModelConfig, max_new_tokens, temperature, top_k, top_p, eos_token_id, max_len):
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts must be an integer array [B, S] or a list of token-id lists, got "
                             f"{arr.dtype}{list(arr.shape)}")
        rows = [list(map(int, r)) for r in arr]
    else:
        rows = [list(r) for r in prompts]
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        for t in r:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"prompt {b} holds a non-integer token {t!r}")
            if not 0 <= t < cfg.vocab_size:
                raise ValueError(f"prompt {b} holds token id {t} outside the vocabulary [0, {cfg.vocab_size})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no top-k), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if eos_token_id is not None and not (isinstance(eos_token_id, (int, np.integer)) and 0 <= eos_token_id < cfg.vocab_size):
        raise ValueError(f"eos_token_id must be a token id in [0, {cfg.vocab_size}) or None, got {eos_token_id!r}")
    longest = max(map(len, rows))
    need = longest + max_new_tokens
    if max_len is None:
        max_len = -(-need // 128) * 128  # rounded up so nearby requests share compiled shapes
    elif isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    if longest > max_len:
        raise ValueError(f"a prompt of {longest} tokens is longer than max_len={max_len}")
    if need > max_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                         f"max_len={max_len}")
    return rows, int(max_len)


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


@partial(jax.jit, static_argnums=(7,), donate_argnums=(1,))
def _decode_loop(params, cache, logits, buf, lengths, max_new, key, cfg, temperature, top_k, top_p, eos):
    """Feeds one token per row per iteration until every row is done or the buffer is full.

    params: as `unstack_layers` gives them (on CPU: the large layer weights split per layer,
    once per generate call, outside this program).
    buf int32 `[B, total]` holds the prompts and receives the generated tokens. Returns (buf,
    tokens generated per row, the cache)."""
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
        done = done | (generating & (tok == eos)) | (n_gen >= max_new)
        logits, cache = step(params, cache, tok[:, None], cfg, True)
        return cache, logits[:, 0], buf, n_gen, done, key

    n_gen = jnp.zeros((B,), jnp.int32)
    state = (cache, logits, buf, n_gen, jnp.zeros((B,), bool), key)
    cache, _, buf, n_gen, _, _ = jax.lax.while_loop(cond, body, state)
    return buf, n_gen, cache  # the cache is returned so that the donated input buffers alias it


def prefill_chunks(length: int, chunk: int = PREFILL_CHUNK) -> list[int]:
    """Chunk sizes covering `length` tokens: full chunks, then powers of two, so a handful of
    compiled shapes serve every prompt length."""
    sizes = [chunk] * (length // chunk)
    rest = length % chunk
    bit = 1 << max(rest.bit_length() - 1, 0)
    while rest:
        if rest >= bit:
            sizes.append(bit)
            rest -= bit
        bit >>= 1
    return sizes


def generate(model: Model, prompts: Sequence[Sequence[int]] | np.ndarray, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eos_token_id: int | None = None,
             seed: int = 0, max_len: int | None = None, **options) -> GenerateOutput:
    """Continues each prompt by up to max_new_tokens tokens.

    prompts: a list of token-id lists (ragged) or an int array `[B, S]`. Greedy at temperature
    0, else sampling with top_k / top_p; a row stops at eos_token_id. max_len (default: the
    longest prompt plus max_new_tokens, rounded up to a multiple of 128) sizes the cache.
    Invalid input raises ValueError before anything runs. `options` override the model's
    run-time options for this call (e.g. use_index_cache=True, index_topk_freq=2; see `load`).
    """
    cfg = with_options(model.config, **options)
    rows, max_len = _validate(prompts, cfg, max_new_tokens, temperature, top_k, top_p, eos_token_id, max_len)
    B = len(rows)
    lengths = np.array([len(r) for r in rows], np.int32)
    total = int(lengths.max()) + max_new_tokens
    buf = np.zeros((B, total), np.int32)
    for b, r in enumerate(rows):
        buf[b, : len(r)] = r

    params = unstack_layers(model.params)
    cache = init_cache(cfg, B, max_len, model.dtype)
    common = int(lengths.min())
    pos = 0
    for size in prefill_chunks(common):
        logits, cache = _prefill(params, cache, jnp.asarray(buf[:, pos: pos + size]), cfg, True)
        pos += size
    out, n_gen, _ = _decode_loop(
        params, cache, logits[:, 0], jnp.asarray(buf), jnp.asarray(lengths), jnp.int32(max_new_tokens),
        jax.random.PRNGKey(seed), cfg, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
        jnp.int32(-1 if eos_token_id is None else eos_token_id))
    out, n_gen = np.asarray(out), np.asarray(n_gen)
    tokens = np.zeros((B, max_new_tokens), np.int32)
    for b in range(B):
        tokens[b, : n_gen[b]] = out[b, lengths[b]: lengths[b] + n_gen[b]]
    return GenerateOutput(tokens=tokens, lengths=n_gen.astype(np.int32))
