"""Lightning indexer: scores every visible compressed entry for each query and keeps the top-k.

score[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j]) / sqrt(index_head_dim), with
w = weights_proj(x) / sqrt(index_n_heads), all in fp32. Entry j is visible to the query at
absolute position t iff j < (t + 1) // ratio.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def indexer_scores(q: jnp.ndarray, keys: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    """q `[B, T, HI, dI]`, keys `[B, N, dI]`, weights `[B, T, HI]` (already / sqrt(HI)) ->
    scores fp32 `[B, T, N]`."""
    # keys as the left operand, its rows contracted along their last (contiguous) axis: with the
    # keys on the right XLA:CPU first copied the whole key pool transposed, on every decode step
    s = jnp.einsum("bnd,bthd->bnth", keys.astype(jnp.float32), q.astype(jnp.float32))
    s = jax.nn.relu(s) * (q.shape[-1] ** -0.5)
    return jnp.einsum("bnth,bth->btn", s, weights.astype(jnp.float32))


def select_topk(scores: jnp.ndarray, n_visible: jnp.ndarray, k: int) -> jnp.ndarray:
    """Top-k visible entries per query.

    scores fp32 `[B, T, N]`; n_visible int `[B, T]` (entries 0..n_visible-1 are visible).
    Returns int32 `[B, T, k]`, best first; slots beyond the visible count hold -1.

    Ties break deterministically: among equal scores the lower entry index ranks first
    (`lax.top_k` is stable), so the same scores always select the same set.
    """
    entry = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    visible = entry < n_visible[..., None]
    masked = jnp.where(visible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)
    return jnp.where(idx < n_visible[..., None], idx, -1).astype(jnp.int32)
