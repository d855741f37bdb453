"""Where every array lives on a device mesh.

Each parameter and cache leaf has logical axis names, one per dimension (`param_axes`,
`cache_axes`); a `Layout` maps logical axes to the mesh axes `data`, `expert` and `tensor` (any
subset of them may be in the mesh, with any sizes that divide the dimensions). The presets:

* "dp_attention" (the default; the layout DeepSeek and vLLM recommend with one K=V head):
  attention is data-parallel, every device attending for its own sequences (batch over every
  mesh axis), the routed experts split over `expert` and `tensor` (expert parallelism), every
  other weight replicated;
* "tp_attention": attention heads split over `tensor` (each device keeps the one K=V head, so the
  cache is replicated over `tensor`), sequences over `data` and `expert`, the routed experts over
  `expert` and their width (and the shared expert's) over `tensor`, the vocabulary over `tensor`;
* "data_parallel": sequences over every mesh axis, every weight replicated.

A model on a mesh (`load(..., mesh=, layout=)`) carries its Layout in `ModelConfig.layout` (a
static, hashable run-time option) and runs its jitted programs under `jax.set_mesh(mesh)`;
GSPMD partitions the dense work from the arrays' shardings, and the per-device code (the routed
experts, which exchange tokens, and the Pallas kernels, which the compiler cannot partition)
runs in `shard_map` (`per_device`).

On TPU v7 the bf16 weight stacks that XLA's own products read are laid out in the tiles those
products read (`product_tiled`, applied by `load` and dsv4-plan).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import layout as xla_layout
from jax.sharding import NamedSharding, PartitionSpec as P

from .cache import ROW_LEAVES
from .config import ModelConfig
from .params import NATIVE_QUANT

MESH_AXES = ("data", "expert", "tensor")

# Logical axes. Unnamed (None) dimensions are never split.
BATCH = "batch"  # sequences: cache rows, activations, the tokens of a chunk
VOCAB = "vocab"  # embedding and head rows
HEADS = "heads"  # attention query heads (wq_b's output, wo_a's groups, wo_b's input, sinks)
EXPERTS = "experts"  # routed experts
EXPERT_MLP = "expert_mlp"  # a routed expert's intermediate width
MLP = "mlp"  # the shared expert's intermediate width
LOGICAL_AXES = (BATCH, VOCAB, HEADS, EXPERTS, EXPERT_MLP, MLP)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Rules mapping logical axes to mesh axes: `rules` is a tuple of (logical axis, tuple of mesh
    axes, major first). Logical axes without a rule, and mesh axes not in the mesh, are not split."""

    name: str
    rules: tuple[tuple[str, tuple[str, ...]], ...]

    def __post_init__(self):
        seen = set()
        for logical, axes in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"layout {self.name!r}: unknown logical axis {logical!r}; known: {list(LOGICAL_AXES)}")
            if logical in seen:
                raise ValueError(f"layout {self.name!r}: logical axis {logical!r} has two rules")
            seen.add(logical)
            bad = [a for a in axes if a not in MESH_AXES]
            if bad:
                raise ValueError(f"layout {self.name!r}: {logical!r} maps to unknown mesh axes {bad}; "
                                 f"mesh axes are {list(MESH_AXES)}")

    def axes(self, logical: str | None, mesh) -> tuple[str, ...]:
        """The mesh axes (present in `mesh`, size > 1) that split `logical`."""
        if logical is None:
            return ()
        for name, axes in self.rules:
            if name == logical:
                return tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
        return ()

    def spec(self, logical_axes: tuple, mesh, shape: tuple | None = None) -> P:
        """The PartitionSpec of an array whose dimensions have these logical axes. With `shape`,
        a dimension its axes do not divide is not split: a quantized weight's block scales, e.g.
        `[out / 128, in / 128]`, have fewer rows than the mesh has pieces on small models."""
        parts = []
        for d, logical in enumerate(logical_axes):
            axes = self.axes(logical, mesh)
            if shape is not None and shape[d] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*parts)

    def shards(self, logical: str, mesh) -> int:
        """How many pieces `logical` is split into."""
        return math.prod(mesh.shape[a] for a in self.axes(logical, mesh))


PRESETS = {
    "dp_attention": Layout("dp_attention", ((BATCH, ("data", "expert", "tensor")), (EXPERTS, ("expert", "tensor")))),
    "tp_attention": Layout("tp_attention", ((BATCH, ("data", "expert")), (HEADS, ("tensor",)), (VOCAB, ("tensor",)),
                                            (EXPERTS, ("expert",)), (EXPERT_MLP, ("tensor",)), (MLP, ("tensor",)))),
    "data_parallel": Layout("data_parallel", ((BATCH, ("data", "expert", "tensor")),)),
}
DEFAULT_LAYOUT = "dp_attention"


def get_layout(layout: str | Layout | None) -> Layout:
    """A Layout from a preset name (None: the default) or a Layout."""
    if layout is None:
        layout = DEFAULT_LAYOUT
    if isinstance(layout, Layout):
        return layout
    if layout not in PRESETS:
        raise ValueError(f"unknown layout {layout!r}; presets: {sorted(PRESETS)}")
    return PRESETS[layout]


def make_mesh(shape: dict[str, int], devices=None) -> jax.sharding.Mesh:
    """A mesh with the named axes (a subset of data, expert, tensor, in that order) and sizes,
    e.g. {"data": 2, "expert": 4}, over `devices` (default: all of them)."""
    import numpy as np

    bad = [a for a in shape if a not in MESH_AXES]
    if bad:
        raise ValueError(f"unknown mesh axes {bad}; mesh axes are {list(MESH_AXES)}")
    names = tuple(a for a in MESH_AXES if a in shape)
    sizes = tuple(int(shape[a]) for a in names)
    devices = jax.devices() if devices is None else list(devices)
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, there are {len(devices)}")
    return jax.sharding.Mesh(np.asarray(devices).reshape(sizes), names)


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,expert=4' -> {"data": 2, "expert": 4} (the CLIs' --mesh)."""
    shape = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1 or name in shape:
            raise ValueError(f"--mesh must be AXIS=SIZE pairs separated by commas, each axis one of "
                             f"{list(MESH_AXES)} at most once, e.g. data=2,expert=4; got {text!r}")
        shape[name] = int(size)
    return shape


def add_arguments(parser) -> None:
    """The CLIs' mesh flags."""
    parser.add_argument("--mesh", help="run on a device mesh, e.g. data=2,expert=4 (sizes multiply to the "
                                       "number of devices, of every process)")
    parser.add_argument("--layout", choices=sorted(PRESETS), help=f"where arrays live on --mesh (default "
                                                                  f"{DEFAULT_LAYOUT})")


# ---- logical axes of every leaf -----------------------------------------------------------

_PARAM_AXES = {  # by the leaf's path without its leading stacked axes; leaves not listed: replicated
    ("embed",): (VOCAB, None),
    ("head",): (VOCAB, None),
    ("layers", "attn", "wq_b"): (HEADS, None),
    ("layers", "attn", "wo_a"): (HEADS, None),
    ("layers", "attn", "wo_b"): (None, HEADS),
    ("layers", "attn", "sink"): (HEADS,),
    ("layers", "ffn", "w1"): (EXPERTS, EXPERT_MLP, None),
    ("layers", "ffn", "w3"): (EXPERTS, EXPERT_MLP, None),
    ("layers", "ffn", "w2"): (EXPERTS, None, EXPERT_MLP),
    ("layers", "ffn", "shared_w1"): (MLP, None),
    ("layers", "ffn", "shared_w3"): (MLP, None),
    ("layers", "ffn", "shared_w2"): (None, MLP),
}


def param_axes(path: tuple[str, ...], ndim: int) -> tuple:
    """Logical axes of the parameter at `path` (as in `params.param_spec`) with `ndim` dims; the
    leading stacked axes (layers, kind-local layers) are never split."""
    own = _PARAM_AXES.get(path, ())
    return (None,) * (ndim - len(own)) + own


def matrix_axes(path: tuple[str, ...]) -> tuple:
    """Logical axes of the last two dims `[out, in]` of the weight at `path` (what a
    QuantizedWeight carries for the matmul kernels)."""
    return param_axes(path, 2)[-2:]


def cache_axes(path: tuple[str, ...], ndim: int) -> tuple:
    """Logical axes of a cache leaf: `pos`, `shared`, `folded` `[B]` and the block table `[B, nb]` by rows,
    every stack `[n, B, ...]` by rows, a pool `[n, NB, E, d]` by blocks (a row's blocks on its
    rows' devices: the engine hands them out so)."""
    if path in ROW_LEAVES:
        return (BATCH,) + (None,) * (ndim - 1)
    return (None, BATCH) + (None,) * (ndim - 2)


def _named(fn, tree, mesh, layout: Layout):
    """NamedShardings for every leaf of a nested dict (QuantizedWeights: values and scale share
    the logical axes of the weight they store, as their dims match it one for one)."""
    from .quantized import QuantizedWeight

    def named(path, shape):
        return NamedSharding(mesh, layout.spec(fn(path, len(shape)), mesh, shape))

    def walk(node, path):
        if isinstance(node, dict):
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, QuantizedWeight):
            return node.replace(values=named(path, node.values.shape), scale=named(path, node.scale.shape))
        return named(path, node.shape)

    return walk(tree, ())


def param_shardings(params, mesh, layout: Layout):
    """A tree like `params` (arrays, QuantizedWeights or ShapeDtypeStructs) of NamedShardings."""
    return _named(param_axes, params, mesh, layout)


def mtp_shardings(block, mesh, layout: Layout):
    """NamedShardings for the MTP block's tree (dsv4_jax/model/mtp.py): its leaves are named and shaped as
    a main layer's, so they split as `layers.*` do."""
    return _named(lambda path, ndim: param_axes(("layers",) + path, ndim), block, mesh, layout)


def cache_shardings(cache, mesh, layout: Layout):
    """A tree like `cache` (arrays or ShapeDtypeStructs) of NamedShardings: rows over `batch`."""
    return _named(cache_axes, cache, mesh, layout)


def named_sharding_of(mesh, layout: Layout) -> Callable[[str, tuple], NamedSharding]:
    """The per-array sharding function `load` asks with a stored array's dotted path and shape
    (a quantized weight's `values` / `scale` as `layers.ffn.w1.values`: the weight's axes)."""
    def of(name: str, shape: tuple) -> NamedSharding:
        path = tuple(name.split("."))
        if path[-1] in ("values", "scale") and path[:-1] in _PARAM_AXES:
            path = path[:-1]
        return NamedSharding(mesh, layout.spec(param_axes(path, len(shape)), mesh, shape))

    return of


# ---- tiles of the weight stacks ----------------------------------------------------------------

# The bf16 weight stacks that XLA's own products read, one layer's slice per step of the layer
# scan: the FP8 linears of `NATIVE_QUANT` when held as floats, the router, the indexer's head
# weights and the compressors. The other weights are kernel operands (the routed experts and wo_a
# go to the grouped matmul, a QuantizedWeight's arrays to the FP8 / FP4 kernels) or are gathered
# (embed).
_PRODUCT_STACKS = frozenset({path for path, fmt in NATIVE_QUANT.items() if fmt == "fp8"} | {
    ("layers", "ffn", "gate"), ("csa", "indexer", "weights_proj"),
    ("csa", "compressor", "wkv"), ("csa", "compressor", "wgate"), ("csa", "indexer", "compressor", "wkv"),
    ("csa", "indexer", "compressor", "wgate"), ("hca", "compressor", "wkv"), ("hca", "compressor", "wgate"),
})

# By device kind, the tiles of a bf16 operand of XLA's products where they are not the tiles it
# gives an argument: TPU v7 multiplies bf16 in (16, 128) tiles and lays arguments out in (8,
# 128), so a stack handed over in the default layout is re-laid out whole in every step
# (docs/plan.md). v5p and v6e multiply in the default tiles.
_PRODUCT_TILES = {"TPU7x": ((16, 128), (2, 1))}


def product_tiled(params):
    """`params` (arrays, QuantizedWeights or ShapeDtypeStructs, each with its sharding) with the
    bf16 weight stacks XLA's products read laid out in the tiles those products read on their
    devices (arrays moved there, their old buffers donated; ShapeDtypeStructs given that
    `Format`). On every device but TPU v7 that is the default layout: `params` itself."""
    from .quantized import QuantizedWeight

    def place(path, x):
        if isinstance(x, QuantizedWeight) or tuple(k.key for k in path) not in _PRODUCT_STACKS:
            return x
        tiles = _PRODUCT_TILES.get(next(iter(x.sharding.device_set)).device_kind)
        if tiles is None or x.dtype != jnp.bfloat16 or not _whole_tiles(x.sharding.shard_shape(x.shape), tiles[0]):
            return x
        fmt = xla_layout.Format(xla_layout.Layout(major_to_minor=tuple(range(x.ndim)), tiling=tiles), x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fmt)
        return jax.device_put(x, fmt, donate=True)

    return jax.tree_util.tree_map_with_path(place, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def _whole_tiles(shape: tuple[int, ...], tile: tuple[int, int]) -> bool:
    """Whether the matrices of a stack of `shape` fill whole tiles: a stack of smaller matrices
    keeps the default layout (the TPU compiler aborts on an argument smaller than its tile)."""
    return shape[-2] % tile[0] == 0 and shape[-1] % tile[1] == 0


def check_divisible(cfg: ModelConfig, mesh, layout: Layout) -> None:
    """Raises ValueError naming the first dimension a layout cannot split evenly on this mesh."""
    sizes = {HEADS: cfg.num_heads, VOCAB: cfg.vocab_size, EXPERTS: cfg.n_routed_experts,
             EXPERT_MLP: cfg.moe_intermediate_size, MLP: cfg.moe_intermediate_size}
    for logical, n in sizes.items():
        k = layout.shards(logical, mesh)
        if n % k:
            raise ValueError(f"layout {layout.name!r} splits {logical} ({n}) into {k} pieces on mesh "
                             f"{dict(mesh.shape)}: {n} is not divisible by {k}")
    groups = layout.shards(HEADS, mesh)
    if groups > 1 and cfg.o_groups % groups:
        raise ValueError(f"layout {layout.name!r} splits the heads into {groups} pieces but o_groups "
                         f"({cfg.o_groups}) is not divisible by {groups}")


# ---- per-device code ------------------------------------------------------------------------

def active(cfg: ModelConfig):
    """The mesh a traced computation runs on, when the model has a layout and a mesh is set
    (`jax.set_mesh`), else None."""
    if cfg.layout is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def rows_axis(cfg: ModelConfig, rows: int) -> str | None:
    """BATCH, for `rows` rows that the model's mesh can split as it splits sequences (whole rows
    per device); None (kept whole on every device) off a mesh or when they do not divide."""
    mesh = active(cfg)
    return BATCH if mesh is not None and rows % cfg.layout.shards(BATCH, mesh) == 0 else None


def per_device(cfg: ModelConfig, fn: Callable, in_axes: tuple, out_axes: tuple) -> Callable:
    """fn run once per device on its shards (`shard_map`) when the model runs on a mesh, else fn
    itself. in_axes: the logical axes of each argument (None: replicated; a pytree argument, e.g.
    a QuantizedWeight, takes one for all its leaves); out_axes: those of fn's one output."""
    mesh = active(cfg)
    if mesh is None:
        return fn
    layout = cfg.layout

    def spec(axes):
        return P() if axes is None else layout.spec(axes, mesh)

    def arg_spec(axes, arg):
        from .quantized import QuantizedWeight

        if not isinstance(arg, QuantizedWeight) or axes is None:
            return spec(axes)
        values, scale = (layout.spec(axes, mesh, a.shape) for a in (arg.values, arg.scale))
        if values != scale or values != spec(axes):  # a device's piece must hold whole scale blocks
            raise ValueError(f"layout {layout.name!r} splits a {arg.fmt} weight {list(arg.shape)} as {spec(axes)} "
                             f"on mesh {dict(mesh.shape)}, but its block scales {list(arg.scale.shape)} do not "
                             f"split evenly that way: use a layout or mesh that splits fewer of its dimensions")
        return values

    def run(*args):
        in_specs = tuple(arg_spec(a, x) for a, x in zip(in_axes, args, strict=True))
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec(out_axes), check_vma=False)(*args)

    return run


def constrain(cfg: ModelConfig, x: jnp.ndarray, axes: tuple) -> jnp.ndarray:
    """x with its sharding pinned to the logical axes `axes` when the model runs on a mesh."""
    mesh = active(cfg)
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, cfg.layout.spec(axes, mesh)))


def constrain_cache(cfg: ModelConfig, cache: dict) -> dict:
    """The cache with every leaf pinned to its rows' sharding when the model runs on a mesh."""
    if active(cfg) is None:
        return cache
    return jax.tree_util.tree_map_with_path(
        lambda p, a: constrain(cfg, a, cache_axes(tuple(k.key for k in p), a.ndim)), cache)
