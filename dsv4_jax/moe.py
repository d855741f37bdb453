"""Mixture of experts: sqrt(softplus) router (learned top-k with a selection-only bias, or a
fixed token -> experts hash table), routed SwiGLU experts clamped at `swiglu_limit`, and one
shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layer_weights import with_weight
from .linear import dense, weight_array


def router_scores(x: jnp.ndarray, gate: jnp.ndarray) -> jnp.ndarray:
    """x `[T, D]`, gate `[E, D]` -> sqrt(softplus(logits)) fp32 `[T, E]` (the gate runs in fp32)."""
    logits = dense(x.astype(jnp.float32), gate.astype(jnp.float32))
    return jnp.sqrt(jax.nn.softplus(logits))


def route(scores: jnp.ndarray, experts: jnp.ndarray, scale: float) -> jnp.ndarray:
    """Weights of the chosen experts `[T, k]`: unbiased scores, renormalised, times scale.
    The 1e-20 keeps all-underflowed scores at weight 0 instead of NaN."""
    w = jnp.take_along_axis(scores, experts, axis=-1)
    return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * scale


def learned_choice(scores: jnp.ndarray, bias: jnp.ndarray, k: int) -> jnp.ndarray:
    """Top-k of scores + bias (the bias only selects); ties go to the lower expert id."""
    return jax.lax.top_k(scores + bias.astype(jnp.float32), k)[1].astype(jnp.int32)


def swiglu(h1: jnp.ndarray, h3: jnp.ndarray, limit: float) -> jnp.ndarray:
    """silu(min(h1, limit)) * clamp(h3, -limit, limit) in fp32 (no clamp when limit is 0)."""
    h1, h3 = h1.astype(jnp.float32), h3.astype(jnp.float32)
    if limit > 0:
        h1 = jnp.minimum(h1, limit)
        h3 = jnp.clip(h3, -limit, limit)
    return jax.nn.silu(h1) * h3


def _block_size(rows: int, n_experts: int) -> int:
    """Rows per expert block: 1 for decode-sized batches (each row reads only its own expert),
    growing with the rows per expert for prefill (fewer weight gathers, bounded padding)."""
    per_expert = rows // n_experts
    b = 1
    while b * 2 <= min(per_expert, 256):
        b *= 2
    return b


def _experts(w, ids: jnp.ndarray, layer=None) -> jnp.ndarray:
    """The experts `ids` of w `[E, ...]` (or of layer `layer` of w `[L, E, ...]`) as an array
    `[len(ids), ...]`. QuantizedWeight experts are gathered still quantized, then dequantized."""
    if layer is not None:
        return weight_array(w[layer, ids])
    return with_weight(lambda w, ids: weight_array(w[ids]), w, ids)


def routed_experts(x: jnp.ndarray, experts: jnp.ndarray, weights: jnp.ndarray, w1: jnp.ndarray,
                   w2: jnp.ndarray, w3: jnp.ndarray, limit: float, layer=None) -> jnp.ndarray:
    """Sum over each token's chosen experts of weight * expert(x).

    x `[T, D]`; experts int `[T, k]`; weights fp32 `[T, k]`; w1/w3 `[E, I, D]`, w2 `[E, D, I]`
    (arrays, QuantizedWeights or LayerWeights), or, with `layer`, the stacks `[L, E, ...]` of
    every layer: each block then reads its expert straight out of the stack (a layer's slice of
    the stack would be copied whole first).
    Returns fp32 `[T, D]`. The (token, slot) rows are sorted by expert into blocks of b rows
    that each belong to one expert, so the work is T*k rows (plus at most b-1 padding rows per
    expert), never all experts for every token. The routing weight multiplies the activation
    before the down projection, as in the reference.
    """
    T, k = experts.shape
    E = w1.shape[0] if layer is None else w1.shape[1]
    rows = T * k
    b = _block_size(rows, E)
    n_blocks = -(-(rows + E * (b - 1)) // b)
    flat_e = experts.reshape(-1)
    flat_t = jnp.repeat(jnp.arange(T, dtype=jnp.int32), k)
    flat_w = weights.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    counts = jnp.zeros((E,), jnp.int32).at[flat_e].add(1)
    padded = (counts + b - 1) // b * b
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(counts) - counts
    dest = padded_start[sorted_e] + jnp.arange(rows, dtype=jnp.int32) - start[sorted_e]
    slot_token = jnp.full((n_blocks * b,), T, jnp.int32).at[dest].set(flat_t[order])
    slot_weight = jnp.zeros((n_blocks * b,), jnp.float32).at[dest].set(flat_w[order])
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_end, jnp.arange(n_blocks, dtype=jnp.int32) * b, side="right"), E - 1)

    x_pad = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)], axis=0)
    xs = x_pad[slot_token].reshape(n_blocks, b, -1)
    ws = slot_weight.reshape(n_blocks, b, 1)

    def ffn(xb, hw, w1, w2, w3):  # xb [n, b, D], hw [n, b, 1]; each block's expert [n, ...]
        h1 = jnp.einsum("nbd,nid->nbi", xb.astype(w1.dtype), w1, preferred_element_type=jnp.float32)
        h3 = jnp.einsum("nbd,nid->nbi", xb.astype(w3.dtype), w3, preferred_element_type=jnp.float32)
        h = swiglu(h1.astype(w1.dtype), h3.astype(w3.dtype), limit) * hw
        y = jnp.einsum("nbi,ndi->nbd", h.astype(w2.dtype), w2, preferred_element_type=jnp.float32)
        return y.astype(w2.dtype).astype(jnp.float32)

    if b == 1:  # decode-sized: every row at once, each with its own expert's weights
        y = ffn(xs, ws, *(_experts(w, block_expert, layer) for w in (w1, w2, w3)))
    else:
        # One block at a time, and only the blocks that hold rows: on CPU a batched product over
        # every block's gathered weights ran several times slower than this loop.
        def block(n, y):
            e = block_expert[n][None]
            out = ffn(xs[n][None], ws[n][None], *(_experts(w, e, layer) for w in (w1, w2, w3)))
            return jax.lax.dynamic_update_index_in_dim(y, out[0], n, 0)

        y = jax.lax.fori_loop(0, padded_end[-1] // b, block, jnp.zeros((n_blocks, b, x.shape[1]), jnp.float32))
    out = jnp.zeros((T + 1, x.shape[1]), jnp.float32).at[slot_token].add(y.reshape(n_blocks * b, -1))
    return out[:T]


def shared_expert(x: jnp.ndarray, w1: jnp.ndarray, w2: jnp.ndarray, w3: jnp.ndarray, limit: float) -> jnp.ndarray:
    """The shared expert (clamped like the routed ones): `[T, D]` -> `[T, D]` in w2's dtype."""
    h = swiglu(dense(x, w1), dense(x, w3), limit)
    return dense(h.astype(w2.dtype), w2)
