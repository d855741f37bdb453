"""One buffer per layer for the large weights, for `generate` on CPU.

Inside the layer scan a layer reads its weights out of the stacked arrays with a dynamic slice.
TPU and GPU compilers fuse that slice into the matmul that consumes it; XLA:CPU does not: it
copies the layer's slice of every weight before each matmul, and on a decode step (a handful
of rows per weight) those copies cost more than the matmuls themselves. So `generate` splits the
large stacked weights into one array per layer once per call, before its prefill and decode
loop (`unstack_layers`: `PerLayer` leaves), and a layer reaches
its own with a `lax.switch` over the layers wrapped around the op that reads it
(`LayerWeight.apply`): each branch reads its buffer in place. The split costs one copy of those
weights per `generate` call, held while it runs.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from .quantized import QuantizedWeight

# Matmul weights (named w*, shared_w*, and the hyper-connections' fn) whose per-layer slice has
# at least this many elements get their own buffers; smaller ones (the indexer's head weights)
# are cheap to slice.
MIN_ELEMENTS = 1 << 15
STACKS = ("layers", "csa", "hca")  # the params subtrees stacked over (kind-local) layers


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


def _is_leaf(x) -> bool:
    return isinstance(x, (QuantizedWeight, PerLayer))


@jax.jit
def _layer_parts(stacked: list) -> list:
    """Each stacked weight `[L, ...]` as its L layers, all in one program: op by op, or inside
    the decode loop's program, XLA:CPU ran the same copies about 3x slower (flash-mini: ~150
    ms against ~45 ms). Only the weights being split go through it, so nothing else is copied."""
    return [tuple(x[i] for i in range(x.shape[0])) for x in stacked]


def unstack_layers(params: dict) -> dict:
    """params with the large leaves of the layer stacks (`STACKS`) split into PerLayer leaves
    when running on CPU (every other leaf is the same array); unchanged elsewhere."""
    if jax.default_backend() != "cpu":
        return params

    def large(path, x) -> bool:
        name = path[-1].key.removeprefix("shared_")
        return (not isinstance(x, PerLayer) and (name.startswith("w") or name == "fn")
                and math.prod(x.shape[1:]) >= MIN_ELEMENTS)

    leaves, treedef = jax.tree_util.tree_flatten_with_path({k: params[k] for k in STACKS if k in params},
                                                           is_leaf=_is_leaf)
    parts = iter(_layer_parts([x for path, x in leaves if large(path, x)]))
    split = [PerLayer(next(parts)) if large(path, x) else x for path, x in leaves]
    return {**params, **jax.tree_util.tree_unflatten(treedef, split)}


def take_layer(tree, i: jnp.ndarray):
    """Layer i of every leaf of a stacked tree: a slice of a stacked array, or a LayerWeight."""

    def take(x):
        if isinstance(x, PerLayer):
            return LayerWeight(x.parts, i)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), x)

    return jax.tree.map(take, tree, is_leaf=_is_leaf)


def with_weight(fn, w, *args):
    """fn(w, *args), for w an array, a QuantizedWeight or a LayerWeight."""
    if isinstance(w, LayerWeight):
        return w.apply(fn, *args)
    return fn(w, *args)
