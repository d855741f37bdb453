"""How the model runs on XLA:CPU, chosen in one place: `choose`.

CPU is the test bench, not the target, and XLA:CPU runs some of the model's math much slower
in the form TPU and GPU want. The model's modules (linear, attention, moe) write the math once
and call `choose(*operands, cpu=..., device=...)` where CPU runs it another way, as the
kernels choose their implementation (`pallas_kernels._dispatch`): per lowering platform, so a
program compiled here for TPU or GPU never holds a CPU form. What CPU runs instead:

* `dense`: the whole dequantized weight (bit for bit a dequantized checkpoint's products and
  sums), as a batch of two half-weight products where that threads and the plain product
  does not (`in_halves`);
* `routed_experts`: the (token, expert) pairs in blocks of one expert each, every block's
  expert gathered out of its stack, in place of the grouped-matmul kernel; with one buffer per
  expert, one pair at a time (`_each_pair`);
* the per-layer and per-expert buffers that `generate` makes on CPU
  (dsv4_jax/model/layer_weights.py: `unstack_layers`), reached through switches (`with_weight`,
  `with_expert`). Only CPU programs hold them, so `choose` hands operands holding one straight
  to the CPU function.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from .layer_weights import LayerExperts, LayerWeight, with_weight
from .quantized import QuantizedWeight

_CPU_ONLY = (LayerWeight, LayerExperts)


def choose(*operands, cpu: Callable, device: Callable, portable: bool = False):
    """cpu(*operands) in a program lowered for XLA:CPU, device(*operands) elsewhere (TPU, GPU);
    with `portable`, device(*operands) everywhere (a cpu form without reverse mode: the program
    can then be differentiated). Operands holding a per-layer buffer (CPU's generate only) go to
    cpu without tracing device."""
    if any(isinstance(x, _CPU_ONLY) for x in jax.tree.leaves(operands, is_leaf=lambda x: isinstance(x, _CPU_ONLY))):
        return cpu(*operands)
    if portable:
        return device(*operands)
    return jax.lax.platform_dependent(*operands, cpu=cpu, default=device)


def dense(w, x: jnp.ndarray, product: Callable | None = None) -> jnp.ndarray:
    """`linear.dense` on CPU: x `[..., in]` times w `[out, in]` (any form `dense` takes) by
    product(w, x) when given (the FP8-activation mode's), else by the whole weight, dequantized,
    in w's compute dtype with fp32 products."""
    return with_weight(product or _whole, w, x)


def _whole(w, x: jnp.ndarray) -> jnp.ndarray:
    wd = w.dequantize() if isinstance(w, QuantizedWeight) else w
    x = x.astype(wd.dtype)
    if in_halves(x, wd):
        n, k = wd.shape
        xs = jnp.broadcast_to(x, (2,) + x.shape)
        y = jnp.einsum("p...i,poi->...po", xs, wd.reshape(2, n // 2, k),
                       preferred_element_type=jnp.float32).reshape(*x.shape[:-1], n)
    else:
        y = jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32)
    return y.astype(wd.dtype)


# A weight of at least this many elements, multiplied by few enough rows that the product stays under
# HALVES_MAX_PRODUCT multiply-adds, goes as a batch of two half-weight products (`in_halves`).
HALVES_MIN_ELEMENTS = 1 << 17
HALVES_MAX_PRODUCT = 1 << 20


def in_halves(x: jnp.ndarray, w: jnp.ndarray) -> bool:
    """Whether to multiply by w as two halves of its rows in one batched product: XLA:CPU runs a
    product of a few rows by a 1-4 MB (fp32) weight on one thread, and the batched form on both.
    Larger products are threaded already."""
    rows = math.prod(x.shape[:-1])
    return (w.ndim == 2 and w.shape[0] % 2 == 0 and w.size >= HALVES_MIN_ELEMENTS
            and rows * w.size < HALVES_MAX_PRODUCT)


def routed_experts(x, experts, weights, w1, w2, w3, *, ffn: Callable, sorted_pairs: Callable, layer=None,
                   first_expert=None) -> jnp.ndarray:
    """`moe.routed_experts` on CPU: blocks of b rows of one expert each (b from `block_size`),
    every block's expert gathered out of its stack (w `[E, ...]`, or with `layer` the stacks
    `[L, E, ...]`), or read in place (LayerExperts). ffn(w1, w2, w3, rows `[R, D]`, routing
    weights fp32 `[R, 1]`) -> fp32 `[R, D]` is one expert's math; sorted_pairs is
    `moe._sorted_pairs`. Returns fp32 `[T, D]`."""
    T, k = experts.shape
    in_place = isinstance(w1, LayerExperts)
    E = w1.n_experts if in_place else w1.shape[0] if layer is None else w1.shape[1]
    rows = T * k
    b = block_size(rows, E)

    order, flat_e, counts = sorted_pairs(experts, E, first_expert)
    sorted_e, sorted_t, sorted_w = flat_e[order], order // k, weights.reshape(-1)[order]
    if b == 1 and in_place:
        return _each_pair(x, sorted_e, sorted_t, sorted_w, (w1, w2, w3), ffn)
    n_blocks = -(-(rows + E * (b - 1)) // b)
    padded = (counts + b - 1) // b * b
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(counts) - counts
    e = jnp.minimum(sorted_e, E - 1)
    dest = jnp.where(sorted_e < E, padded_start[e] + jnp.arange(rows, dtype=jnp.int32) - start[e], n_blocks * b)
    slot_token = jnp.full((n_blocks * b,), T, jnp.int32).at[dest].set(sorted_t, mode="drop")
    slot_weight = jnp.zeros((n_blocks * b,), jnp.float32).at[dest].set(sorted_w, mode="drop")
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_end, jnp.arange(n_blocks, dtype=jnp.int32) * b, side="right"), E - 1)

    x_pad = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)], axis=0)
    xs = x_pad[slot_token].reshape(n_blocks, b, -1)
    ws = slot_weight.reshape(n_blocks, b, 1)

    def gathered(ids):  # the experts `ids` of each weight, `[len(ids), ...]`, still quantized
        return [(w[ids] if layer is None else w[layer, ids]) for w in (w1, w2, w3)]

    if b == 1 and first_expert is None:  # decode-sized: every row at once, each with its own expert's weights
        y = jax.vmap(ffn)(*gathered(block_expert), xs, ws)
    else:
        # One block at a time, and only the blocks that hold rows (with expert parallelism, only
        # this device's): a batched product over every block's gathered weights ran several
        # times slower than this loop.
        def block(n, y):
            if in_place:
                out = with_expert((w1, w2, w3), block_expert[n], ffn, xs[n], ws[n])
            else:
                out = ffn(*(w[0] for w in gathered(block_expert[n][None])), xs[n], ws[n])
            return jax.lax.dynamic_update_index_in_dim(y, out, n, 0)

        y = jax.lax.fori_loop(0, padded_end[-1] // b, block, jnp.zeros((n_blocks, b, x.shape[1]), jnp.float32))
    out = jnp.zeros((T + 1, x.shape[1]), jnp.float32).at[slot_token].add(y.reshape(n_blocks * b, -1))
    return out[:T]


def block_size(rows: int, n_experts: int) -> int:
    """Rows per expert block: 1 for decode-sized batches (each row reads only its own expert),
    growing with the rows per expert for prefill (fewer weight gathers, bounded padding)."""
    per_expert = rows // n_experts
    b = 1
    while b * 2 <= min(per_expert, 256):
        b *= 2
    return b


def _each_pair(x, pair_expert, pair_row, pair_weight, w, ffn) -> jnp.ndarray:
    """`routed_experts` for a decode-sized batch with LayerExperts w = (w1, w2, w3): each
    (row, slot) pair (its expert, row and routing weight, `[T * k]` each, in expert order) as a
    one-row FFN, so that an expert two rows chose is read again from cache: a product of one
    row by a weight runs at several times the rate of a product of 8 rows by it here.
    x `[T, D]` -> fp32 `[T, D]`."""

    def one(j, y):
        t = pair_row[j]
        out = with_expert(w, pair_expert[j], ffn, jax.lax.dynamic_slice_in_dim(x, t, 1),
                          pair_weight[j].reshape(1, 1))
        return jax.lax.dynamic_update_slice_in_dim(y, jax.lax.dynamic_slice_in_dim(y, t, 1) + out, t, 0)

    return jax.lax.fori_loop(0, pair_expert.shape[0], one, jnp.zeros(x.shape, jnp.float32))


def with_expert(weights: tuple, e: jnp.ndarray, fn, *args):
    """fn(expert e's weight from each of `weights` (LayerExperts of one layer), *args): a switch
    over the layers, then over that layer's experts, each branch reading its buffers in place.
    (One flat switch over every (layer, expert) hands each branch all the buffers, and compiles
    slower.)"""
    n = weights[0].n_experts

    def layer(i):
        def experts(e, *args):
            own = zip(*(w.parts[i * n:(i + 1) * n] for w in weights))
            return jax.lax.switch(e, [partial(fn, *ws) for ws in own], *args)
        return experts

    return jax.lax.switch(weights[0].index, [layer(i) for i in range(len(weights[0].parts) // n)], e, *args)

