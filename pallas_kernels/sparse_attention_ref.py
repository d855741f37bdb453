"""Plain-JAX reference of the sparse-gather attention with a per-head sink.

Each query attends to the kv rows its index row names (window slots and compressed entries
alike; K = V, one shared head). The sink is an extra logit per head that enters only the
softmax denominator.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import kv_record
from .numerics import rotate_heads, unweighted_rms_norm


def sparse_attention_ref(q: jnp.ndarray, kv: jnp.ndarray, indices: jnp.ndarray, sink: jnp.ndarray,
                         query_rope: tuple[jnp.ndarray, jnp.ndarray] | None = None, *, scale: float,
                         rope_dim: int | None = None, q_norm_eps: float | None = None) -> jnp.ndarray:
    """q `[B, T, H, D]`, kv `[B, N, D]`, indices int32 `[B, T, K]` into kv's N axis (-1: no key),
    sink fp32 `[H]`. With rope_dim, kv is FP8 records instead, as uint32 words `[B, N, R / 4]`
    (`kv_record.to_words`) of D values whose last rope_dim are RoPE'd, read as the values they
    decode to. Returns `[B, T, H, D]` in q's dtype:

        o_h = sum_s exp(l_s - m) kv_s / (sum_s exp(l_s - m) + exp(sink_h - m)),  l_s = scale q_h.kv_s

    with the softmax and accumulation in fp32; a row with no valid key gives 0.

    With query_rope = (cos, sin), fp32 `[B, T, rope/2]` each at the queries' positions, q comes
    unrotated: its heads are rotated (`rotate_heads`, rounded to q's dtype) before the product.
    o is left as the products give it, at the queries' rotation: the model rotates it back in
    its output projection (`block_diagonal_matmul`'s x_rope).
    With q_norm_eps, q comes before its per-head norm as well: each head is first scaled by its
    unweighted RMS (`unweighted_rms_norm`).
    """
    if q_norm_eps is not None:
        q = unweighted_rms_norm(q, q_norm_eps)
    if query_rope is not None:
        q = rotate_heads(q, query_rope)
    if rope_dim is not None:
        kv = kv_record.decode(kv_record.from_words(kv), q.shape[-1], rope_dim, jnp.float32)
    valid = indices >= 0
    rows = jnp.take_along_axis(kv[:, None, :, :], jnp.where(valid, indices, 0)[..., None], axis=2)
    rows = rows.astype(jnp.float32)  # [B, T, K, D]
    # Logits as [B, T, K, H] (the rows on the left): XLA on CPU runs this batched product several
    # times faster than the [B, T, H, K] form.
    logits = jnp.einsum("btkd,bthd->btkh", rows, q.astype(jnp.float32)) * scale
    logits = jnp.where(valid[..., None], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)
    m = jnp.maximum(jnp.max(logits, axis=2, keepdims=True), sink)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=2, keepdims=True) + jnp.exp(sink - m)
    out = jnp.einsum("btkh,btkd->bthd", p / denom, rows)
    return out.astype(q.dtype)
