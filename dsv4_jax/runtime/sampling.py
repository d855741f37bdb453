"""Choosing the next token of each row: greedy, or a draw with temperature, min-p, top-k and
top-p, each row with its own parameters and its own random stream, after the row's own adjustments
of the logits (`Controls`, `adjusted`): logit bias, stop ids held back until min_tokens, repetition,
frequency and presence penalties, and a grammar's token mask. `logprobs` reads the model's own
distribution (before any of this, as vLLM's default "raw" logprobs do).

The order, per row: logits + logit_bias; the row's stop ids at -inf while it has drawn fewer than
min_tokens; the repetition penalty (a logit of a token seen in the prompt or the output divided
by it when positive, multiplied when negative); minus frequency_penalty x the token's count in the
output and presence_penalty where that count is non-zero; the grammar's mask; then temperature
(argmax at 0), min_p (tokens below min_p x the top probability dropped), top-k and top-p.

A row's draws depend only on its seed and on how many tokens it has drawn (`row_keys`), never on
the rows beside it, so a request sampled by the serving engine gives the tokens `generate` gives
for it alone with the same seed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias
MAX_STOP_IDS = 32  # stop token ids a request with min_tokens holds back


class Controls(NamedTuple):
    """Each row's adjustments of its logits (module doc), all traced: presence, frequency and
    repetition penalties fp32 `[R]` (neutral: 0, 0, 1); logit bias as entries bias_ids
    int32 `[R, MAX_LOGIT_BIAS]` (the vocabulary size V: no entry) and bias_values fp32; min_tokens
    int32 `[R]` and the stop ids it holds back, stop_ids int32 `[R, MAX_STOP_IDS]` (V: none); the
    grammar's allowed tokens as a bitmask int32 `[R, ceil(V / 32)]` (bit i of word j: token 32 j
    + i; -1: every token)."""

    presence: jnp.ndarray
    frequency: jnp.ndarray
    repetition: jnp.ndarray
    bias_ids: jnp.ndarray
    bias_values: jnp.ndarray
    min_tokens: jnp.ndarray
    stop_ids: jnp.ndarray
    mask: jnp.ndarray

    @classmethod
    def neutral(cls, rows: int, vocab_size: int) -> "Controls":
        """Controls that change nothing, as numpy arrays to fill in."""
        R, V = rows, vocab_size
        return cls(np.zeros(R, np.float32), np.zeros(R, np.float32), np.ones(R, np.float32),
                   np.full((R, MAX_LOGIT_BIAS), V, np.int32), np.zeros((R, MAX_LOGIT_BIAS), np.float32),
                   np.zeros(R, np.int32), np.full((R, MAX_STOP_IDS), V, np.int32),
                   np.full((R, mask_words(V)), -1, np.int32))


def mask_words(vocab_size: int) -> int:
    """32-bit words of a row's token bitmask."""
    return -(-vocab_size // 32)


def only_token(token: int, vocab_size: int) -> np.ndarray:
    """A bitmask row int32 `[ceil(V / 32)]` (Controls.mask) allowing `token` alone."""
    row = np.zeros(mask_words(vocab_size), np.uint32)
    row[token // 32] = 1 << (token % 32)
    return row.view(np.int32)


def allowed(mask: jnp.ndarray, vocab_size: int) -> jnp.ndarray:
    """A bitmask int32 `[R, W]` (Controls.mask) as bool `[R, V]`."""
    v = jnp.arange(vocab_size)
    return ((mask[:, v // 32] >> (v % 32)) & 1).astype(bool)


def adjusted(logits: jnp.ndarray, c: Controls, drawn: jnp.ndarray, counts: jnp.ndarray | None = None,
             prompt: jnp.ndarray | None = None) -> jnp.ndarray:
    """fp32 logits `[R, V]` after each row's controls (module doc; temperature and the cut-offs
    come later, in `sample` / `distribution`). drawn int32 `[R]`: tokens each row has drawn;
    counts int32 `[R, V]`: each token's count in the row's output so far and prompt bool `[R, V]`:
    the tokens of its prompt (None: no penalties). A row the mask would leave with no token keeps
    its logits unmasked (a grammar always allows something; this keeps a bug from becoming NaN)."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    x = logits.at[rows, c.bias_ids].add(c.bias_values, mode="drop")
    held = jnp.where((drawn < c.min_tokens)[:, None], -jnp.inf, 0.0)
    x = x.at[rows, c.stop_ids].add(jnp.broadcast_to(held, c.stop_ids.shape), mode="drop")
    if counts is not None:
        out = counts > 0
        rep = c.repetition[:, None]
        x = jnp.where(out | prompt, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - c.frequency[:, None] * counts.astype(x.dtype) - c.presence[:, None] * out
    masked = jnp.where(allowed(c.mask, V), x, -jnp.inf)
    return jnp.where(jnp.any(masked > -jnp.inf, axis=-1, keepdims=True), masked, x)


def logprobs(logits: jnp.ndarray, tokens: jnp.ndarray, top: int = MAX_TOP_LOGPROBS):
    """The model's log-probabilities (log-softmax of the raw fp32 logits `[..., V]`) of `tokens`
    `[...]` and the `top` most likely: (chosen `[...]`, top ids int32 `[..., top]`, top
    log-probabilities `[..., top]`, most likely first)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, top)
    return chosen, top_ids.astype(jnp.int32), top_lp


def row_keys(seeds: jnp.ndarray, drawn: jnp.ndarray) -> jnp.ndarray:
    """The keys `[B, 2]` of rows with int `seeds` `[B]` drawing their token number `drawn` `[B]`."""
    return jax.vmap(lambda s, n: jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(s), n)))(seeds, drawn)


def _restricted(logits: jnp.ndarray, t, k, p, min_p) -> jnp.ndarray:
    """One row's logits `[V]` / t with every token outside the top k (0: all), outside the
    smallest set whose probability reaches p, or below min_p x the top probability, set to -inf
    (the most likely token is always kept)."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(t, 1e-6)
    ordered = jnp.sort(scaled)[::-1]
    kth = ordered[jnp.clip(jnp.where(k > 0, k, V) - 1, 0, V - 1)]
    probs = jax.nn.softmax(ordered)
    before = jnp.cumsum(probs) - probs  # probability mass strictly above each token
    # The first token is kept whatever p: a top_p that rounds to 0 in float32 keeps only it.
    kept = ((before < p) | (jnp.arange(V) == 0)) & (ordered >= kth) & (probs >= min_p * probs[0])
    cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf))
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _params(B: int, temperature, top_k, top_p, min_p):
    return tuple(jnp.broadcast_to(jnp.asarray(a), (B,)) for a in (temperature, top_k, top_p, min_p))


def distribution(logits: jnp.ndarray, temperature, top_k, top_p, min_p=0.0) -> jnp.ndarray:
    """The distribution `sample` draws from, fp32 `[B, V]`: one-hot on the argmax at temperature 0,
    else softmax(logits / temperature) restricted by top_k, top_p and min_p (see `sample`)."""
    B, V = logits.shape
    t, k, p, m = _params(B, temperature, top_k, top_p, min_p)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)

    def drawn():
        probs = jax.nn.softmax(jax.vmap(_restricted)(logits, t, k, p, m), axis=-1)
        return jnp.where((t > 0)[:, None], probs, greedy)

    return jax.lax.cond(jnp.any(t > 0), drawn, lambda: greedy)


def sample(logits: jnp.ndarray, keys: jnp.ndarray, temperature, top_k, top_p, min_p=0.0) -> jnp.ndarray:
    """Next tokens int32 `[B]` from fp32 logits `[B, V]`.

    Row b: argmax at temperature[b] == 0 (ties: the lowest id), else a draw with keys[b] (raw
    uint32 `[2]`) from softmax(logits / temperature) restricted to the top_k[b] most likely tokens
    (0: all), to the smallest set whose probability reaches top_p[b] and to the tokens of at least
    min_p[b] x the top probability (the most likely token is always kept). temperature, top_k,
    top_p, min_p: `[B]` or scalars; traced, so changing them does not recompile. The sort only
    runs when some row samples."""
    B = logits.shape[0]
    t, k, p, m = _params(B, temperature, top_k, top_p, min_p)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        def one(row, key, t, k, p, m):
            return jax.random.categorical(jax.random.wrap_key_data(key),
                                          _restricted(row, t, k, p, m)).astype(jnp.int32)

        return jnp.where(t > 0, jax.vmap(one)(logits, keys, t, k, p, m), greedy)

    return jax.lax.cond(jnp.any(t > 0), draw, lambda: greedy)
