"""The forms a layer's weight takes in the layer scan: a stacked weight read in place
(`LayerSlice`), and one buffer per layer for the large weights, for `generate` on CPU
(dsv4_jax/model/xla_cpu.py runs them).

Inside the layer scan a layer reads its weights out of the stacked arrays with a dynamic slice.
TPU and GPU compilers fuse that slice into the matmul that consumes it; XLA:CPU does not: it
copies the layer's slice of every weight before each matmul, and on a decode step (a handful
of rows per weight) those copies cost more than the matmuls themselves. So `generate` splits the
large stacked weights into one array per layer once per call, before its prefill and decode
loop (`unstack_layers`: `PerLayer` leaves), and a layer reaches
its own with a `lax.switch` over the layers wrapped around the op that reads it
(`LayerWeight.apply`): each branch reads its buffer in place. The routed experts go one step
further, one buffer per (layer, expert) (`PerExpert` leaves), since a gather of the chosen
experts out of a layer's `[E, ...]` stack is a copy too: a layer reaches an expert with a switch
over the layers, then over the layer's experts, wrapped around that expert's whole FFN
(`xla_cpu.with_expert`). The split costs one copy of those weights per `generate` call, held while it
runs.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .layer_kinds import COMPRESSED
from .quantized import QuantizedWeight, blocks_divide

# Matmul weights (named w*, shared_w*, and the hyper-connections' fn) whose per-layer slice has
# at least this many elements get their own buffers; smaller ones (the indexer's head weights)
# are cheap to slice.
MIN_ELEMENTS = 1 << 15
# Routed experts get a buffer each while layers x experts stays below this: every buffer is a
# branch of the experts' switch, compiled into each program that runs the layers (flash-mini: 128).
# Larger models keep their experts stacked and gather the chosen ones.
MAX_EXPERT_BUFFERS = 1024
ROUTED = ("w1", "w2", "w3")  # the routed experts' weights, `[L, E, ...]` in params["layers"]["ffn"]
STACKS = ("layers", *(k.name for k in COMPRESSED))  # the params subtrees stacked over (kind-local) layers


@struct.dataclass
class PerLayer:
    """A stacked weight `[L, ...]` as L arrays (or QuantizedWeights) `[...]`."""

    parts: tuple


@struct.dataclass
class LayerWeight:
    """Layer i's weight from a PerLayer: `.apply(fn, *args)` is fn(the weight, *args)."""

    parts: tuple
    index: jnp.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.parts[0].shape

    @property
    def dtype(self):
        return self.parts[0].dtype

    def astype(self, dtype) -> "LayerWeight":
        return LayerWeight(tuple(p.astype(dtype) for p in self.parts), self.index)

    def apply(self, fn, *args):
        return jax.lax.switch(self.index, [partial(fn, p) for p in self.parts], *args)


# Plain (unquantized) stacked weights that a kernel reads in place (attention.output's wo_a, the
# routed experts, the hyper-connections' fn): with every QuantizedWeight, `take_layer` gives them
# as LayerSlices.
IN_PLACE = ("wo_a", "fn") + ROUTED


@struct.dataclass
class LayerSlice:
    """Layer `index` of a stacked weight `[L, ...]` (a QuantizedWeight, or a plain one in
    IN_PLACE), not sliced out yet: the matmul kernels read it in place (`linear.dense`,
    `attention.output`), since a kernel's operand sliced out of the stack is a copy of it;
    everything else takes `.weight`, the slice (which XLA fuses into its consumer)."""

    stack: QuantizedWeight | jnp.ndarray
    index: jnp.ndarray

    @property
    def weight(self) -> QuantizedWeight | jnp.ndarray:
        return self.stack[self.index]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    @property
    def fmt(self) -> str:
        return self.stack.fmt

    def blocked(self) -> bool:
        """`QuantizedWeight.blocked` of the layer's weight (False for a plain one)."""
        return (isinstance(self.stack, QuantizedWeight) and self.stack.ndim == 3
                and blocks_divide(self.stack.shape, self.stack.fmt))


@struct.dataclass
class PerExpert:
    """A stacked routed-expert weight `[L, E, ...]` as L * E arrays (or QuantizedWeights) `[...]`,
    layer-major."""

    parts: tuple
    n_experts: int = struct.field(pytree_node=False)


@struct.dataclass
class LayerExperts:
    """Layer `index`'s experts from a PerExpert (read through `xla_cpu.with_expert`)."""

    parts: tuple
    index: jnp.ndarray
    n_experts: int = struct.field(pytree_node=False)


def _is_leaf(x) -> bool:
    return isinstance(x, (QuantizedWeight, PerLayer, PerExpert))


@partial(jax.jit, static_argnums=1)
def _split(stacked: list, lead: tuple[int, ...]) -> list:
    """Each stacked weight as its parts over its `lead` leading axes (row-major), all in one
    program: op by op, or inside the decode loop's program, XLA:CPU ran the same copies several
    times slower. Only the weights being split go through it, so nothing else is copied."""
    return [tuple(x[i] for i in np.ndindex(*x.shape[:n])) for x, n in zip(stacked, lead)]


def unstack_layers(params: dict) -> dict:
    """params with the large leaves of the layer stacks (`STACKS`) split into PerLayer leaves,
    and the routed experts into PerExpert leaves (see MAX_EXPERT_BUFFERS), when running on CPU
    (every other leaf is the same array); unchanged elsewhere, and on a device mesh (where the
    experts are split over devices)."""
    on_many = any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(params) if isinstance(x, jax.Array))
    if jax.default_backend() != "cpu" or on_many:
        return params

    def lead(path, x) -> int:
        """How many leading axes to split x over: 0 (kept stacked), 1 (layers) or 2 (experts)."""
        keys = tuple(k.key for k in path)
        name = keys[-1].removeprefix("shared_")
        if isinstance(x, (PerLayer, PerExpert)) or not (name.startswith("w") or name == "fn"):
            return 0
        if math.prod(x.shape[1:]) < MIN_ELEMENTS:
            return 0
        if keys[:2] == ("layers", "ffn") and keys[-1] in ROUTED:
            return 2 if math.prod(x.shape[:2]) <= MAX_EXPERT_BUFFERS else 0
        return 1

    leaves, treedef = jax.tree_util.tree_flatten_with_path({k: params[k] for k in STACKS if k in params},
                                                           is_leaf=_is_leaf)
    leads = [lead(path, x) for path, x in leaves]
    parts = iter(_split([x for (_, x), n in zip(leaves, leads) if n], tuple(n for n in leads if n)))
    split = [x if n == 0 else PerLayer(next(parts)) if n == 1 else PerExpert(next(parts), x.shape[1])
             for (_, x), n in zip(leaves, leads)]
    return {**params, **jax.tree_util.tree_unflatten(treedef, split)}


def take_layer(tree, i: jnp.ndarray):
    """Layer i of every leaf of a stacked tree: a slice of a stacked array, a LayerSlice (of a
    stacked QuantizedWeight, or of an IN_PLACE weight), a LayerWeight or LayerExperts."""

    def take(path, x):
        if isinstance(x, PerLayer):
            return LayerWeight(x.parts, i)
        if isinstance(x, PerExpert):
            return LayerExperts(x.parts, i, x.n_experts)
        if isinstance(x, QuantizedWeight) or (path and getattr(path[-1], "key", None) in IN_PLACE):
            return LayerSlice(x, i)
        return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)

    return jax.tree_util.tree_map_with_path(take, tree, is_leaf=_is_leaf)


def own_weight(w):
    """w, or a LayerSlice's weight (sliced out of its stack)."""
    return w.weight if isinstance(w, LayerSlice) else w


def with_weight(fn, w, *args):
    """fn(w, *args), for w an array, a QuantizedWeight, a LayerSlice or a LayerWeight."""
    if isinstance(w, LayerWeight):
        return w.apply(fn, *args)
    return fn(own_weight(w), *args)
