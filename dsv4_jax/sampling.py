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


def sample(logits: jnp.ndarray, keys: jnp.ndarray, temperature, top_k, top_p) -> jnp.ndarray:
    """Next tokens int32 `[B]` from fp32 logits `[B, V]`.

    Row b: argmax at temperature[b] == 0 (ties: the lowest id), else a draw with keys[b] (raw
    uint32 `[2]`) from softmax(logits / temperature) restricted to the top_k[b] most likely tokens
    (0: all) and to the smallest set whose probability reaches top_p[b] (the most likely token is
    always kept). temperature, top_k, top_p: `[B]` or scalars; traced, so changing them does not
    recompile. The sort only runs when some row samples."""
    B, V = logits.shape
    t, k, p = (jnp.broadcast_to(jnp.asarray(a), (B,)) for a in (temperature, top_k, top_p))
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw_row(row, key, t, k, p):
        scaled = row / jnp.maximum(t, 1e-6)
        ordered = jnp.sort(scaled)[::-1]
        kth = ordered[jnp.clip(jnp.where(k > 0, k, V) - 1, 0, V - 1)]
        probs = jax.nn.softmax(ordered)
        before = jnp.cumsum(probs) - probs  # probability mass strictly above each token
        cutoff = jnp.min(jnp.where((before < p) & (ordered >= kth), ordered, jnp.inf))
        masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
        return jax.random.categorical(jax.random.wrap_key_data(key), masked).astype(jnp.int32)

    def draw():
        drawn = jax.vmap(draw_row)(logits, keys, t, k, p)
        return jnp.where(t > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(t > 0), draw, lambda: greedy)
