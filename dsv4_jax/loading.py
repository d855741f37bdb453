"""`load(path)`: a model from a checkpoint directory (HF safetensors, or our converted one)."""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .model import Model, with_options
from .params import leaf_dtype, map_spec, param_spec
from .quantized import QuantizedWeight

PARAMS_DIR = "params"
MTP_DIR = "mtp"


def is_converted(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `dsv4-convert`."""
    path = os.fspath(path)
    cfg = os.path.join(path, "config.json")
    if not (os.path.isdir(os.path.join(path, PARAMS_DIR)) and os.path.isfile(cfg)):
        return False
    try:
        with open(cfg) as f:
            return "dsv4_jax" in json.load(f)
    except (OSError, json.JSONDecodeError):
        return False


def load(path: str | os.PathLike, dtype=jnp.float32,
         sharding: jax.sharding.Sharding | Callable[[str, tuple], jax.sharding.Sharding] | None = None,
         mesh: jax.sharding.Mesh | None = None, layout=None, **options) -> Model:
    """Loads the model in `path`: either a directory written by `dsv4-convert` (config.json plus
    the Orbax checkpoint `params/`, restored through Orbax), or an HF checkpoint directory holding `config.json` and
    safetensors (single file or sharded with `model.safetensors.index.json`; official or
    transformers naming; float, FP8 or FP4 weights, dequantized on the fly). `dtype` is the
    compute dtype of the weights (float32 or bfloat16); norms, hyper-connections, sinks, `ape`,
    gate and compressor weights stay in float32. A `--dtype native` conversion's FP8/FP4 leaves
    come back as `QuantizedWeight`s (stored values and scales, `dtype` as their compute dtype),
    dequantized inside the matmuls. `sharding`, when given, is either one Sharding for every
    array (e.g. a NamedSharding on a mesh) or a function (dotted tree path, stored shape) ->
    Sharding, asked once per stored array (a QuantizedWeight's `values` and `scale` apart, as
    `layers.ffn.w1.values`), e.g. to split the routed experts over a mesh axis; each device
    reads only its own shard from disk (a converted directory; an HF one is read whole, then
    placed).
    `mesh` (a `jax.sharding.Mesh` with axes among data, expert, tensor) puts the model on a device
    mesh: every array is read straight onto its sharding under `layout` (a preset name of
    dsv4_jax/sharding.py, default "dp_attention", or a `sharding.Layout`; quantized weights split
    like their float forms), and the returned model's programs run on that mesh.
    `options` set the run-time fields of ModelConfig (`attention_impl`, `use_index_cache`,
    `index_topk_freq`, `index_topk_pattern`, `index_cache_skip_compressor`) over what
    config.json says."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg = with_options(ModelConfig.from_hf(path), **options)
    if mesh is not None:
        if sharding is not None:
            raise ValueError("give either `mesh` (with a layout) or `sharding`, not both")
        from . import sharding as sh

        lay = sh.get_layout(layout)
        sh.check_divisible(cfg, mesh, lay)
        cfg = cfg.replace(layout=lay)
        sharding = sh.named_sharding_of(mesh, lay)
    elif layout is not None:
        raise ValueError("`layout` needs a `mesh`")
    model = _load(path, cfg, dtype, sharding)
    return model if mesh is None else model.replace(mesh=mesh)


def _load(path: str, cfg: ModelConfig, dtype, sharding) -> Model:
    if is_converted(path):
        return Model(params=_restore(path, cfg, dtype, sharding), config=cfg)
    from convert import read_hf_checkpoint

    params, _mtp = read_hf_checkpoint(path, cfg, dtype)
    if sharding is None:
        return Model(params=jax.tree.map(jnp.asarray, params), config=cfg)

    def put(p, x):
        return jax.device_put(x, _sharding_of(sharding, jax.tree_util.keystr(p, simple=True, separator="."), x.shape))

    return Model(params=jax.tree_util.tree_map_with_path(put, params), config=cfg)


def _sharding_of(sharding, name: str, shape) -> jax.sharding.Sharding:
    return sharding(name, tuple(shape)) if callable(sharding) else sharding


def _check_tree(pdir: str, want: dict) -> None:
    """Every array the target asks for is in the checkpoint with the expected shape (Orbax itself
    would pad or truncate a misshapen one); `want` maps tree paths to shapes."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(pdir)
    meta = getattr(meta, "item_metadata", meta)
    meta = getattr(meta, "tree", meta)
    have = {tuple(str(getattr(k, "key", k)) for k in p): tuple(getattr(m, "shape", ()) or ())
            for p, m in jax.tree_util.tree_flatten_with_path(meta)[0]}
    for path, shape in want.items():
        got = have.get(path)
        if got is None or tuple(got) != tuple(shape):
            raise ValueError(f"{pdir}: array {'.'.join(path)!r} is {'missing' if got is None else list(got)}, "
                             f"the config expects {list(shape)}")


def _restore(path: str, cfg: ModelConfig, dtype, sharding) -> dict:
    """The params/ Orbax checkpoint restored by Orbax onto `sharding` (each device reads its
    own shard), the values / scale subtrees of a native conversion as QuantizedWeights."""
    import orbax.checkpoint as ocp

    from .quantized import storage_shapes

    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pdir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    with open(os.path.join(path, "config.json")) as f:
        quantized = json.load(f).get("quantized") or {}
    want: dict[tuple, tuple] = {}

    def target(p, spec_leaf):
        shape, cls = spec_leaf
        fmt = quantized.get(".".join(p))
        if fmt is not None:
            parts = storage_shapes(tuple(shape), fmt)
            want.update({p + (k,): s for k, (s, _) in parts.items()})
            return {k: jax.ShapeDtypeStruct(s, d, sharding=_sharding_of(sharding, ".".join(p + (k,)), s))
                    for k, (s, d) in parts.items()}
        want[p] = tuple(shape)
        return jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(cls, dtype),
                                    sharding=_sharding_of(sharding, ".".join(p), shape))

    tgt = map_spec(target, param_spec(cfg))
    _check_tree(pdir, want)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(pdir, tgt)

    def build(p, spec_leaf):
        node = params
        for k in p:
            node = node[k]
        fmt = quantized.get(".".join(p))
        if fmt is not None:
            return QuantizedWeight(node["values"], node["scale"], fmt=fmt, dtype_name=jnp.dtype(dtype).name)
        return node

    return map_spec(build, param_spec(cfg))


def _flatten_mtp(tree: dict, leaves: dict, prefix: str = "") -> dict:
    """{'mtp': {'0': {'enorm': {'weight': a}}}} -> {'mtp.0.enorm.weight': a}, stopping at the
    quantized leaves named in `leaves` (their {'values', 'scale'} subtrees)."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and name not in leaves:
            out.update(_flatten_mtp(v, leaves, name))
        else:
            out[name] = v
    return out


def load_mtp(path: str | os.PathLike) -> dict:
    """The `mtp.*` tensors a `dsv4-convert` directory kept (the Orbax checkpoint `mtp/`), by
    their checkpoint names, as numpy arrays (quantized ones of a native conversion dequantized
    to float32)."""
    import ml_dtypes
    import orbax.checkpoint as ocp

    from convert import quant
    from convert.store import read_custom_metadata

    d = os.path.abspath(os.path.join(os.fspath(path), MTP_DIR))
    if not os.path.isdir(d):
        return {}
    leaves = (read_custom_metadata(d) or {}).get("leaves", {})
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore(d)
    out = {}
    for name, v in _flatten_mtp(tree, leaves).items():
        kind = leaves.get(name, {}).get("kind")
        if kind == "fp8":
            out[name] = quant.dequantize_fp8(np.asarray(v["values"]), np.asarray(v["scale"]))
        elif kind == "fp4":
            out[name] = quant.dequantize_fp4(np.asarray(v["values"]).view(np.int8),
                                             np.asarray(v["scale"]).view(ml_dtypes.float8_e8m0fnu))
        else:
            out[name] = np.asarray(v)
    return out
