"""Mixture of experts: sqrt(softplus) router (learned top-k with a selection-only bias, or a
fixed token -> experts hash table), routed SwiGLU experts clamped at `swiglu_limit`, and one
shared expert."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.lax import ragged_all_to_all  # a name here, so that a test can run the exchange on CPU with a twin

import pallas_kernels  # looked up at call time: pallas_kernels imports our primitives
from . import xla_cpu
from .layer_weights import LayerSlice
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


def expert(x: jnp.ndarray, w1, w2, w3, limit: float, hw: jnp.ndarray | None = None, cfg=None,
           fp8_activations: bool = False) -> jnp.ndarray:
    """One SwiGLU expert (w1/w3 `[I, D]`, w2 `[D, I]`) on rows x `[R, D]`: `[R, D]` in w2's dtype.
    A routed expert's routing weights hw fp32 `[R, 1]` multiply the activation before the down
    projection, as in the reference. cfg as for `linear.dense` (none for the routed experts,
    which run per device already); fp8_activations: x and the down projection's input rounded as
    the reference's FP8 quantization rounds them (`fp8_rounded`; the routed experts: their FP4
    weights have no FP8-activation kernel)."""
    x = fp8_rounded(x, fp8_activations)
    h = pallas_kernels.swiglu(dense(x, w1, cfg), dense(x, w3, cfg), limit)
    return dense(down_input(h, hw, w2.dtype, fp8_activations), w2, cfg)


def down_input(h: jnp.ndarray, hw: jnp.ndarray | None, dtype, fp8_activations: bool) -> jnp.ndarray:
    """The down projection's input: the SwiGLU activation h fp32 `[R, I]` times the routing
    weights hw fp32 `[R, 1]` (a routed expert), rounded to the weight's compute dtype (and with
    fp8_activations as the reference's FP8 quantization rounds it)."""
    if hw is not None:
        h = h * hw
    return fp8_rounded(h.astype(dtype), fp8_activations)


def fp8_rounded(x: jnp.ndarray, fp8_activations: bool) -> jnp.ndarray:
    """x, or with fp8_activations x as `pallas_kernels.act_quant` rounds it (`act_quant_rounded`).
    The reference's FP4 GEMM multiplies those values by the weight blocks (converting FP4 to FP8
    is exact), so x rounded this way, times the stored weight, is its product."""
    return pallas_kernels.act_quant_rounded(x) if fp8_activations else x


def routed_experts(x: jnp.ndarray, experts: jnp.ndarray, weights: jnp.ndarray, w1, w2, w3, limit: float,
                   layer=None, first_expert=None, fp8_activations: bool = False, impl: str = "auto") -> jnp.ndarray:
    """Sum over each token's chosen experts of weight * expert(x).

    x `[T, D]`; experts int `[T, k]`; weights fp32 `[T, k]`; w1/w3 `[E, I, D]`, w2 `[E, D, I]`:
    arrays or QuantizedWeights; or one layer of the stacks `[L, E, ...]` of every layer
    (LayerSlices, or the stacks themselves with `layer`): the chosen experts are then read
    straight out of the stack (a layer's slice of the stack would be copied whole first); or
    on CPU one buffer per expert (LayerExperts, dsv4_jax/model/layer_weights.py).
    With `first_expert` (expert parallelism: this device's share of the experts), w holds experts
    first_expert .. first_expert + E - 1 and the pairs choosing others are skipped.
    Returns fp32 `[T, D]`. The (token, slot) pairs are sorted by expert into groups that
    `pallas_kernels.grouped_matmul` multiplies by their experts' stored weights (`_grouped`;
    on CPU `xla_cpu.routed_experts`): the work is T*k rows, never all experts for every token.
    fp8_activations: as for `expert`; impl: `pallas_kernels.grouped_matmul`'s (a model's
    `attention_impl`: "ref" runs no kernel, so the experts can be differentiated).
    """
    if isinstance(w1, LayerSlice):
        w1, w2, w3, layer = w1.stack, w2.stack, w3.stack, w1.index

    def ffn(w1, w2, w3, x, hw):  # one expert's rows, fp32 `[R, D]`
        return expert(x, w1, w2, w3, limit, hw, fp8_activations=fp8_activations).astype(jnp.float32)

    pairs = dict(layer=layer, first_expert=first_expert)
    # "ref": the plain-JAX twins on every platform (XLA:CPU's loop has no reverse mode)
    return xla_cpu.choose(x, experts, weights, w1, w2, w3,
                          cpu=partial(xla_cpu.routed_experts, ffn=ffn, sorted_pairs=_sorted_pairs, **pairs),
                          device=partial(_grouped, limit=limit, fp8_activations=fp8_activations, impl=impl, **pairs),
                          portable=impl == "ref")


ROUTED_SCOPE = "routed_experts"


def _sorted_pairs(experts: jnp.ndarray, n_experts: int, first_expert):
    """The (token, slot) pairs of experts int `[T, k]` in expert order: (order `[T*k]` into the
    flattened pairs, their local expert ids `[T*k]`, n_experts for another device's experts,
    and the pairs each local expert has, int32 `[n_experts]`)."""
    flat_e = experts.reshape(-1)
    if first_expert is not None:  # another device's experts sort last, as expert n_experts, and are not run
        flat_e = flat_e - first_expert
        flat_e = jnp.where((flat_e >= 0) & (flat_e < n_experts), flat_e, n_experts)
    order = jnp.argsort(flat_e, stable=True)
    counts = jnp.zeros((n_experts + 1,), jnp.int32).at[flat_e].add(1)[:n_experts]
    return order, flat_e, counts


def _grouped(x, experts, weights, w1, w2, w3, *, limit, layer=None, first_expert=None,
             fp8_activations=False, impl="auto") -> jnp.ndarray:
    """`routed_experts` by grouped products (`_pair_outputs`), each token's pairs summed in fp32."""
    y, order = _pair_outputs(x, experts, weights, w1, w2, w3, limit, layer, first_expert, fp8_activations, impl)
    return _token_sums(y, order, experts.shape)


def _token_sums(y: jnp.ndarray, order: jnp.ndarray, pairs: tuple[int, int]) -> jnp.ndarray:
    """The outputs y `[T k, D]` (or in pieces `[T k, P, D/P]`) of the (token, slot) pairs of
    pairs = (T, k), y's row i being flattened pair order[i], summed per token in fp32: `[T, D]`.

    On CUDA a gather of each token's k rows summed slot by slot, which XLA fuses with what the
    caller adds to the sum and its rounding (a scatter-add writes an fp32 `[T, D]` that the
    caller's fusion reads back). Elsewhere a scatter-add of the rows into the tokens: on TPU
    the gathers make XLA copy y into its fast memory first, more bytes than the scatter moves
    (dsv4-plan on tpu7x-8). In pieces (the ragged exchange's rows), on every platform, one
    gather of a row per slot added to the running sum, which XLA fuses into one pass (where a
    scatter-add into the pieces, or one gather of every slot, had it convert the rows to fp32
    in a pass of their own), and the sums re-laid out as `[T, D]` after."""
    T, k = pairs

    def slot_rows(order):  # `[T, k]`: the row of y holding each token's pair of each slot
        return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype)).reshape(T, k)

    if y.ndim == 3:
        rows = slot_rows(order)
        total = y[rows[:, 0]].astype(jnp.float32)
        for slot in range(1, k):
            total = total + y[rows[:, slot]].astype(jnp.float32)
        return total.reshape(T, -1)

    def gathered(y, order):
        return jnp.sum(y[slot_rows(order)].astype(jnp.float32), axis=1)

    def scattered(y, order):
        return jnp.zeros((T, y.shape[1]), jnp.float32).at[order // k].add(y.astype(jnp.float32))

    return jax.lax.platform_dependent(y, order, cuda=gathered, default=scattered)


def _pair_outputs(x, experts, weights, w1, w2, w3, limit, layer, first_expert, fp8_activations=False,
                  impl="auto"):
    """The output of each (token, expert) pair of x `[T, D]` and experts `[T, k]`: the pairs' rows
    sorted by expert and run by `_expert_rows`. Returns (y `[T k, D]` in w2's dtype, in expert
    order; order `[T k]`, the flattened pair of each row of y). The pairs of another device's
    experts sort past every group, where the kernel's rows are 0 (so are their h and y)."""
    E = w1.shape[0] if layer is None else w1.shape[1]
    order, _, group_sizes = _sorted_pairs(experts, E, first_expert)
    y = _expert_rows(x[order // experts.shape[1]], weights.reshape(-1)[order], group_sizes, w1, w2, w3,
                     limit, layer, fp8_activations, impl)
    return y, order


def _expert_rows(xs, hw, group_sizes, w1, w2, w3, limit, layer, fp8_activations, impl, pieces: int = 1):
    """Rows xs `[R, D]` in groups by expert (group_sizes int32 `[E]`: the first rows expert 0's,
    then expert 1's ..; rows past the groups are not run and come out 0), their routing weights
    hw fp32 `[R]` (past the groups not read): each group's rows multiplied by its expert's stored
    weights, read once per chosen expert (none for an expert no row chose), products in the
    weights' compute dtype as `expert` computes them -> `[R, D]` in w2's dtype. The first two
    products and their activation are one `pallas_kernels.grouped_swiglu`. With pieces P > 1
    the rows come and go in pieces, `[R, P, D/P]` (`exchange_pieces`)."""
    # (the scope names these calls in the compiled program: dsv4-plan counts the experts that
    # uniform routing chooses in place of the kernels' declared bound, ROUTED_SCOPE)
    with jax.named_scope(ROUTED_SCOPE):
        h = pallas_kernels.grouped_swiglu(fp8_rounded(xs, fp8_activations).astype(w1.dtype), w1, w3, group_sizes,
                                          hw, limit=limit, layer=layer, impl=impl)
        h = fp8_rounded(h.astype(w2.dtype), fp8_activations)
        return pallas_kernels.grouped_matmul(h, w2, group_sizes, layer=layer, out_pieces=pieces, impl=impl)


# The rows a device takes per round of the ragged exchange, as a multiple of the T k pairs it
# sends (on average, when each pair's expert is on any device alike, it receives as many): a
# buffer for the most it could receive (n T k rows) would make its expert work n times what it
# runs on average; a round more runs when one device receives more than this.
EXCHANGE_CAPACITY = 2


def exchange_pieces(width: int, dtype) -> int:
    """The pieces P of a row of `width` values that the ragged exchange moves as `[P, width/P]`:
    on TPU XLA moves a 16-bit row as two pieces (the two sublanes of (2, 128) tiles, so that each
    row is contiguous) and re-lays out any other shape before and after the collective, while
    the experts' kernels read and write the rows in pieces in place. 2 for 16-bit rows whose
    halves the kernels take as they are (`grouped_matmul_tpu.in_pieces`), else 1."""
    return 2 if jnp.dtype(dtype).itemsize == 2 and pallas_kernels.grouped_matmul_tpu.in_pieces(width, 2) else 1


def exchange_rows(tokens: int, k: int, devices: int) -> int:
    """The rows a device receives per round of the ragged exchange (its receive buffer, the rows
    its experts' grouped products take), for `tokens` tokens per device, top-k, over `devices`."""
    return max(1, math.ceil(min(EXCHANGE_CAPACITY, devices) * tokens * k))


def expert_exchange(cfg, mesh) -> str:
    """How `routed_experts_on_mesh` moves tokens on `mesh` (the model's layout, on TPU and GPU:
    CPU always gathers, XLA:CPU has no ragged all-to-all): cfg.expert_exchange unless "auto".

    "auto" takes "ragged_all_to_all" when the layout allows it (every axis that splits the
    experts splits the tokens, and none that splits an expert's width does) and the experts are
    split over more than EXCHANGE_CAPACITY devices: its round's buffer (EXCHANGE_CAPACITY T k
    rows) is then smaller than the all-gather's n T k, which every per-pair op of the experts
    reads and writes. (The bytes sent favour it from fewer devices on: T k (n - 1) / n rows each
    way in bf16 against (n - 1) T rows gathered and reduce-scattered in fp32.)"""
    from .sharding import BATCH, EXPERT_MLP, EXPERTS

    layout = cfg.layout
    ep, mlp, batch = (layout.axes(a, mesh) for a in (EXPERTS, EXPERT_MLP, BATCH))
    possible = bool(ep) and set(ep) <= set(batch) and not set(mlp) & set(batch)
    if cfg.expert_exchange == "ragged_all_to_all":
        if not possible:
            raise ValueError(f"expert_exchange 'ragged_all_to_all' needs every mesh axis that splits the experts "
                             f"({list(ep)}) to split the tokens ({list(batch)}) and none that splits an expert's "
                             f"width ({list(mlp)}) to: layout {layout.name!r} on mesh {dict(mesh.shape)} does not")
        return "ragged_all_to_all"
    if cfg.expert_exchange == "all_gather" or not possible:
        return "all_gather"
    return "ragged_all_to_all" if layout.shards(EXPERTS, mesh) > EXCHANGE_CAPACITY else "all_gather"


def routed_experts_on_mesh(x: jnp.ndarray, experts: jnp.ndarray, weights: jnp.ndarray, w1: LayerSlice,
                           w2: LayerSlice, w3: LayerSlice, limit: float, cfg) -> jnp.ndarray:
    """`routed_experts` with one layer of the stacks `[L, E, ...]` (LayerSlices), split over
    devices (dsv4_jax/model/sharding.py), run per device, the tokens exchanged as `expert_exchange`
    chooses: by all-gather (`_gathered`) or, on TPU and GPU, by ragged all-to-all (`_exchanged`).
    The partial outputs of the devices that split an expert's width (and not the tokens) are
    summed by a psum."""
    from .sharding import BATCH, EXPERT_MLP, EXPERTS, active, per_device

    mesh, layout = active(cfg), cfg.layout
    ep, mlp, batch = (layout.axes(a, mesh) for a in (EXPERTS, EXPERT_MLP, BATCH))
    summed = tuple(a for a in ep + mlp if a not in batch)
    kw = dict(limit=limit, ep=ep, fp8_activations=cfg.fp8_activations, impl=cfg.attention_impl)
    gathered = partial(_gathered, gather=tuple(a for a in batch if a in ep + mlp), **kw)

    def local(*args):
        if expert_exchange(cfg, mesh) == "ragged_all_to_all":
            exchanged = partial(_exchanged, **kw)
            y = xla_cpu.choose(*args, cpu=gathered, device=exchanged)
        else:
            y = gathered(*args)
        return jax.lax.psum(y, summed) if summed else y

    up, down = (None, EXPERTS, EXPERT_MLP, None), (None, EXPERTS, None, EXPERT_MLP)
    rows = (BATCH, None)
    run = per_device(cfg, local, (rows, rows, rows, up, down, up, None), rows)
    return run(x, experts, weights, w1.stack, w2.stack, w3.stack, w1.index)


def _gathered(x, experts, weights, w1, w2, w3, layer, *, limit, ep, gather, fp8_activations, impl) -> jnp.ndarray:
    """Per device: gathers the tokens (x `[T, D]` and their routing) of the devices on the
    `gather` axes, runs the pairs that chose its own experts (the stacks' local share, on its
    slice of their width) and reduce-scatters the fp32 outputs back to the tokens' devices."""
    if gather:
        x, experts, weights = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, experts, weights))
    first = jax.lax.axis_index(ep) * w1.shape[1] if ep else 0
    y = routed_experts(x, experts, weights, w1, w2, w3, limit, layer=layer, first_expert=first,
                       fp8_activations=fp8_activations, impl=impl)
    return jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True) if gather else y


def _exchanged(x, experts, weights, w1, w2, w3, layer, *, limit, ep, fp8_activations, impl) -> jnp.ndarray:
    """Per device: sends each of its (token, expert) pairs (the token's row of x `[T, D]` and its
    routing weight) to the device on the `ep` axes that holds the expert, runs the pairs it
    receives (`_expert_rows`, one row per pair) and sends each pair's output back, where the pairs
    of a token are summed in fp32: fp32 `[T, D]`.

    The pairs go as one slice per (sender, expert), each written where it belongs in its
    receiver's buffer: a device's stream is its experts' rows in expert order, each expert's
    rows by sender, so the rows arrive in the grouped product's order and leave from it (no sort
    or gather of the rows on the receiving side). Every device knows every slice's size (an
    all-gather of the pairs' counts per expert). In rounds of at most C = EXCHANGE_CAPACITY T k
    received rows per device (static shapes): round r moves stream rows r C .. (r + 1) C - 1, and
    all devices run the same number of rounds, ceil(longest stream / C). The rows travel in the
    pieces XLA moves them in (`exchange_pieces`), which the experts' kernels read and write."""
    T, k = experts.shape
    local_experts = w1.shape[1]
    n = math.prod(jax.lax.axis_size(a) for a in ep)
    me = jax.lax.axis_index(ep)
    capacity = exchange_rows(T, k, n)
    flat_e = experts.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # by expert, so by the device that holds it
    counts = jax.lax.all_gather(jnp.zeros((n * local_experts,), jnp.int32).at[flat_e].add(1), ep, axis=0,
                                tiled=False)  # [sender, expert]
    totals = jnp.sum(counts, axis=0).reshape(n, local_experts)  # [device, local expert]
    # where each (sender, expert) slice starts in its sender's sorted pairs and in its receiver's stream
    in_sent = jnp.cumsum(counts, axis=1) - counts
    in_stream = (jnp.cumsum(totals, axis=1) - totals).reshape(-1) + jnp.cumsum(counts, axis=0) - counts
    rounds = -(-jnp.max(jnp.sum(totals, axis=1)) // capacity)
    pieces = exchange_pieces(x.shape[1], w1.dtype)
    x = x.astype(w1.dtype)
    if pieces > 1:  # the pairs' rows `[T k, P, D/P]`, gathered from x in pieces (x is k times smaller)
        x = x.reshape(T, pieces, -1)
    xs, hw = x[order // k], weights.reshape(-1)[order]

    def mine(a):  # [sender, expert] -> the slices of my experts, by sender: `[n local_experts]`
        return jax.lax.dynamic_slice_in_dim(a, me * local_experts, local_experts, axis=1).reshape(-1)

    def one_round(r, back):
        lo = jnp.clip(r * capacity - in_stream, 0, counts)  # [sender, expert]: this round's rows
        count = jnp.clip((r + 1) * capacity - in_stream, 0, counts) - lo
        sent_at, buffer_at = in_sent + lo, in_stream + lo - r * capacity

        def there(rows):  # this round's slices of this device's sorted pairs, into their receivers' streams
            # Left unset past the rows received: the grouped products never read x's rows past
            # their groups (nor take them into another row's output).
            out = jax.lax.empty((capacity,) + rows.shape[1:], rows.dtype)
            return ragged_all_to_all(rows, out, sent_at[me], count[me], buffer_at[me], mine(count), axis_name=ep)

        group_sizes = jnp.sum(mine(count).reshape(n, local_experts), axis=0)  # this round's rows per expert
        y = _expert_rows(there(xs), there(hw), group_sizes, w1, w2, w3, limit, layer, fp8_activations,
                         impl, pieces)
        return ragged_all_to_all(y, back, mine(buffer_at), mine(count), mine(sent_at), count[me], axis_name=ep)

    # unset to start with: the rounds bring back the output of every pair
    back = jax.lax.fori_loop(0, rounds, one_round, jax.lax.empty(xs.shape, w2.dtype))
    return _token_sums(back, order, (T, k))


def shared_expert(x: jnp.ndarray, w1, w2, w3, limit: float, cfg=None) -> jnp.ndarray:
    """The shared expert (clamped like the routed ones): `[T, D]` -> `[T, D]` in w2's dtype."""
    return expert(x, w1, w2, w3, limit, cfg=cfg)
