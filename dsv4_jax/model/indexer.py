"""Lightning indexer: scores every visible compressed entry for each query and keeps the top-k.

score[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j]) / sqrt(index_head_dim), with
w = weights_proj(x) / sqrt(index_n_heads), all in fp32. Entry j is visible to the query at
absolute position t iff j < (t + 1) // ratio. The scores themselves are
`pallas_kernels.indexer_scores` (kernels on TPU and GPU); here the choice from them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def distillation_kl(q: jnp.ndarray, rows: jnp.ndarray, scores: jnp.ndarray, ids: jnp.ndarray,
                    scale: float) -> jnp.ndarray:
    """The indexer's training loss (DeepSeek-V3.2's, on the entries a ratio-4 layer attends to):
    KL(p || softmax(indexer scores)) over each query's chosen entries, where p is the main
    attention's distribution over them (each head's softmax of q . row * scale, summed over heads
    and renormalised), held constant. Mean over the queries that choose any entry.

    q `[B, T, H, Dh]` the main queries (rotated), rows `[B, N, Dh]` the compressed
    entries in entry order, scores fp32 `[B, T, N]` (`attention.indexer_logits`), ids int32
    `[B, T, K]` the chosen entries (-1: none). Returns a fp32 scalar."""
    valid = ids >= 0
    at = jnp.where(valid, ids, 0)
    # masked with a finite floor, not -inf: a query with nothing chosen must not make NaN gradients
    floor = jnp.float32(-1e9)
    logits = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), rows.astype(jnp.float32)) * scale
    chosen = jnp.take_along_axis(logits, at[:, :, None, :], axis=-1)  # [B, T, H, K]
    p = jnp.sum(jax.nn.softmax(jnp.where(valid[:, :, None], chosen, floor), axis=-1), axis=2)
    p = jax.lax.stop_gradient(jnp.where(valid, p, 0.0) / jnp.maximum(jnp.sum(jnp.where(valid, p, 0.0), -1,
                                                                             keepdims=True), 1e-30))
    log_q = jax.nn.log_softmax(jnp.where(valid, jnp.take_along_axis(scores, at, axis=-1), floor), axis=-1)
    kl = jnp.sum(jnp.where(valid, jax.scipy.special.xlogy(p, p) - p * log_q, 0.0), axis=-1)  # [B, T]
    has = jnp.any(valid, axis=-1)
    return jnp.sum(jnp.where(has, kl, 0.0)) / jnp.maximum(jnp.sum(has), 1)
