"""Choosing the next token of each row: greedy, or a draw with temperature, top-k and top-p, each
row with its own parameters and its own random stream.

A row's draws depend only on its seed and on how many tokens it has drawn (`row_keys`), never on
the rows beside it, so a request sampled by the serving engine gives the tokens `generate` gives
for it alone with the same seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seeds: jnp.ndarray, drawn: jnp.ndarray) -> jnp.ndarray:
    """The keys `[B, 2]` of rows with int `seeds` `[B]` drawing their token number `drawn` `[B]`."""
    return jax.vmap(lambda s, n: jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(s), n)))(seeds, drawn)


def _restricted(logits: jnp.ndarray, t, k, p) -> jnp.ndarray:
    """One row's logits `[V]` / t with every token outside the top k (0: all) and outside the
    smallest set whose probability reaches p set to -inf (the most likely token is always kept)."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(t, 1e-6)
    ordered = jnp.sort(scaled)[::-1]
    kth = ordered[jnp.clip(jnp.where(k > 0, k, V) - 1, 0, V - 1)]
    probs = jax.nn.softmax(ordered)
    before = jnp.cumsum(probs) - probs  # probability mass strictly above each token
    # The first token is kept whatever p: a top_p that rounds to 0 in float32 keeps only it.
    kept = ((before < p) | (jnp.arange(V) == 0)) & (ordered >= kth)
    cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf))
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _params(B: int, temperature, top_k, top_p):
    return tuple(jnp.broadcast_to(jnp.asarray(a), (B,)) for a in (temperature, top_k, top_p))


def distribution(logits: jnp.ndarray, temperature, top_k, top_p) -> jnp.ndarray:
    """The distribution `sample` draws from, fp32 `[B, V]`: one-hot on the argmax at temperature 0,
    else softmax(logits / temperature) restricted by top_k and top_p (see `sample`)."""
    B, V = logits.shape
    t, k, p = _params(B, temperature, top_k, top_p)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)

    def drawn():
        probs = jax.nn.softmax(jax.vmap(_restricted)(logits, t, k, p), axis=-1)
        return jnp.where((t > 0)[:, None], probs, greedy)

    return jax.lax.cond(jnp.any(t > 0), drawn, lambda: greedy)


def sample(logits: jnp.ndarray, keys: jnp.ndarray, temperature, top_k, top_p) -> jnp.ndarray:
    """Next tokens int32 `[B]` from fp32 logits `[B, V]`.

    Row b: argmax at temperature[b] == 0 (ties: the lowest id), else a draw with keys[b] (raw
    uint32 `[2]`) from softmax(logits / temperature) restricted to the top_k[b] most likely tokens
    (0: all) and to the smallest set whose probability reaches top_p[b] (the most likely token is
    always kept). temperature, top_k, top_p: `[B]` or scalars; traced, so changing them does not
    recompile. The sort only runs when some row samples."""
    B = logits.shape[0]
    t, k, p = _params(B, temperature, top_k, top_p)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        def one(row, key, t, k, p):
            return jax.random.categorical(jax.random.wrap_key_data(key), _restricted(row, t, k, p)).astype(jnp.int32)

        return jnp.where(t > 0, jax.vmap(one)(logits, keys, t, k, p), greedy)

    return jax.lax.cond(jnp.any(t > 0), draw, lambda: greedy)
