"""Mixture of experts: sqrt(softplus) router (learned top-k with a selection-only bias, or a
fixed token -> experts hash table), routed SwiGLU experts clamped at `swiglu_limit`, and one
shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layer_weights import LayerExperts, with_expert
from .linear import dense


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


def expert(x: jnp.ndarray, w1, w2, w3, limit: float, hw: jnp.ndarray | None = None) -> jnp.ndarray:
    """One SwiGLU expert (w1/w3 `[I, D]`, w2 `[D, I]`) on rows x `[R, D]`: `[R, D]` in w2's dtype.
    A routed expert's routing weights hw fp32 `[R, 1]` multiply the activation before the down
    projection, as in the reference."""
    h = swiglu(dense(x, w1), dense(x, w3), limit)
    if hw is not None:
        h = h * hw
    return dense(h.astype(w2.dtype), w2)


def routed_experts(x: jnp.ndarray, experts: jnp.ndarray, weights: jnp.ndarray, w1, w2, w3, limit: float,
                   layer=None) -> jnp.ndarray:
    """Sum over each token's chosen experts of weight * expert(x).

    x `[T, D]`; experts int `[T, k]`; weights fp32 `[T, k]`; w1/w3 `[E, I, D]`, w2 `[E, D, I]`:
    arrays or QuantizedWeights, or LayerExperts (CPU generate: one buffer per expert, read in
    place), or, with `layer`, the stacks `[L, E, ...]` of every layer: the chosen experts are then
    gathered straight out of the stack (a layer's slice of the stack would be copied whole first).
    Returns fp32 `[T, D]`. The (token, slot) rows are sorted by expert into blocks of b rows
    that each belong to one expert, so the work is T*k rows (plus at most b-1 padding rows per
    expert), never all experts for every token.
    """
    T, k = experts.shape
    in_place = isinstance(w1, LayerExperts)
    E = w1.n_experts if in_place else w1.shape[0] if layer is None else w1.shape[1]
    rows = T * k
    b = _block_size(rows, E)

    def ffn(w1, w2, w3, x, hw):  # fp32 `[R, D]`
        return expert(x, w1, w2, w3, limit, hw).astype(jnp.float32)

    flat_e = experts.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # the (token, slot) pairs in expert order
    sorted_e, sorted_t, sorted_w = flat_e[order], order // k, weights.reshape(-1)[order]
    if b == 1 and in_place:
        return _each_pair(x, sorted_e, sorted_t, sorted_w, (w1, w2, w3), ffn)
    n_blocks = -(-(rows + E * (b - 1)) // b)
    counts = jnp.zeros((E,), jnp.int32).at[flat_e].add(1)
    padded = (counts + b - 1) // b * b
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(counts) - counts
    dest = padded_start[sorted_e] + jnp.arange(rows, dtype=jnp.int32) - start[sorted_e]
    slot_token = jnp.full((n_blocks * b,), T, jnp.int32).at[dest].set(sorted_t)
    slot_weight = jnp.zeros((n_blocks * b,), jnp.float32).at[dest].set(sorted_w)
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_end, jnp.arange(n_blocks, dtype=jnp.int32) * b, side="right"), E - 1)

    x_pad = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)], axis=0)
    xs = x_pad[slot_token].reshape(n_blocks, b, -1)
    ws = slot_weight.reshape(n_blocks, b, 1)

    def gathered(ids):  # the experts `ids` of each weight, `[len(ids), ...]`, still quantized
        return [(w[ids] if layer is None else w[layer, ids]) for w in (w1, w2, w3)]

    if b == 1:  # decode-sized: every row at once, each with its own expert's weights
        y = jax.vmap(ffn)(*gathered(block_expert), xs, ws)
    else:
        # One block at a time, and only the blocks that hold rows: on CPU a batched product over
        # every block's gathered weights ran several times slower than this loop.
        def block(n, y):
            if in_place:
                out = with_expert((w1, w2, w3), block_expert[n], ffn, xs[n], ws[n])
            else:
                out = ffn(*(w[0] for w in gathered(block_expert[n][None])), xs[n], ws[n])
            return jax.lax.dynamic_update_index_in_dim(y, out, n, 0)

        y = jax.lax.fori_loop(0, padded_end[-1] // b, block, jnp.zeros((n_blocks, b, x.shape[1]), jnp.float32))
    out = jnp.zeros((T + 1, x.shape[1]), jnp.float32).at[slot_token].add(y.reshape(n_blocks * b, -1))
    return out[:T]


def _each_pair(x, pair_expert, pair_row, pair_weight, w, ffn) -> jnp.ndarray:
    """`routed_experts` for a decode-sized batch with LayerExperts w = (w1, w2, w3): each
    (row, slot) pair (its expert, row and routing weight, `[T * k]` each, in expert order) as a
    one-row FFN, so that an expert two rows chose is read again from cache. On CPU a product of
    one row by a weight runs at several times the rate of a product of 8 rows by it (flash-mini
    at batch 8: 21.7-22.4 against 17.6-18.5 ms a step, when each used expert ran once over all
    the rows, with weight 0 on those that had not chosen it). x `[T, D]` -> fp32 `[T, D]`."""

    def one(j, y):
        t = pair_row[j]
        out = with_expert(w, pair_expert[j], ffn, jax.lax.dynamic_slice_in_dim(x, t, 1),
                          pair_weight[j].reshape(1, 1))
        return jax.lax.dynamic_update_slice_in_dim(y, jax.lax.dynamic_slice_in_dim(y, t, 1) + out, t, 0)

    return jax.lax.fori_loop(0, pair_expert.shape[0], one, jnp.zeros(x.shape, jnp.float32))


def shared_expert(x: jnp.ndarray, w1, w2, w3, limit: float) -> jnp.ndarray:
    """The shared expert (clamped like the routed ones): `[T, D]` -> `[T, D]` in w2's dtype."""
    return expert(x, w1, w2, w3, limit)
