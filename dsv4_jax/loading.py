"""`load(path)`: a model from a checkpoint directory (HF safetensors, or our converted one)."""

from __future__ import annotations

import json
import os

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


def load(path: str | os.PathLike, dtype=jnp.float32, sharding: jax.sharding.Sharding | None = None,
         **options) -> Model:
    """Loads the model in `path`: either a directory written by `dsv4-convert` (config.json plus
    the array store under `params/`), or an HF checkpoint directory holding `config.json` and
    safetensors (single file or sharded with `model.safetensors.index.json`; official or
    transformers naming; float, FP8 or FP4 weights, dequantized on the fly). `dtype` is the
    compute dtype of the weights (float32 or bfloat16); norms, hyper-connections, sinks, `ape`,
    gate and compressor weights stay in float32. A `--dtype native` conversion's FP8/FP4 leaves
    come back as `QuantizedWeight`s (stored values and scales, `dtype` as their compute dtype),
    dequantized inside the matmuls. `sharding`, when given, is applied to every array (e.g. a
    NamedSharding on a mesh); each device reads only its own shard from disk.
    `options` set the run-time fields of ModelConfig (`attention_impl`, `use_index_cache`,
    `index_topk_freq`, `index_topk_pattern`, `index_cache_skip_compressor`) over what
    config.json says."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg = with_options(ModelConfig.from_hf(path), **options)
    if is_converted(path):
        return Model(params=_restore(path, cfg, dtype, sharding), config=cfg)
    from convert import read_hf_checkpoint

    params, _mtp = read_hf_checkpoint(path, cfg, dtype)
    put = (lambda x: jax.device_put(x, sharding)) if sharding is not None else jnp.asarray
    return Model(params=jax.tree.map(put, params), config=cfg)


def _read_array(reader, name: str, shape, dtype, sharding) -> jax.Array:
    """One stored array onto `sharding`, each addressable shard read from disk on its own."""
    dtype = np.dtype(dtype)

    def shard(index):
        a = reader.read(name, index)
        if a.dtype != dtype:
            a = a.astype(np.float32).astype(dtype) if dtype.kind == "f" or dtype.name == "bfloat16" else a.astype(dtype)
        return a

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def _np(dtype) -> np.dtype:
    import ml_dtypes

    d = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if d == jnp.dtype(jnp.bfloat16) else np.dtype(d)


def _restore(path: str, cfg: ModelConfig, dtype, sharding) -> dict:
    from convert.store import INDEX, StoreReader

    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pdir = os.path.join(path, PARAMS_DIR)
    if not os.path.isfile(os.path.join(pdir, INDEX)):
        return _restore_orbax(path, cfg, dtype, sharding)
    reader = StoreReader(pdir)

    def leaf(p, spec_leaf):
        shape, cls = spec_leaf
        key = ".".join(p)
        meta = reader.leaves.get(key)
        if meta is None or tuple(meta["shape"]) != tuple(shape):
            raise ValueError(f"{pdir}: leaf {key!r} is {'missing' if meta is None else meta['shape']}, "
                             f"the config expects {list(shape)}")
        if meta["kind"] in ("fp8", "fp4"):
            vs = reader.array(f"{key}/values")
            ss = reader.array(f"{key}/scale")
            values = _read_array(reader, f"{key}/values", vs.shape, vs.dtype.numpy_dtype, sharding)
            scale = _read_array(reader, f"{key}/scale", ss.shape, ss.dtype.numpy_dtype, sharding)
            return QuantizedWeight(values, scale, fmt=meta["kind"], dtype_name=jnp.dtype(dtype).name)
        return _read_array(reader, key, shape, _np(leaf_dtype(cls, dtype)), sharding)

    return map_spec(leaf, param_spec(cfg))


def _stored_dtype(path: str):
    with open(os.path.join(path, "config.json")) as f:
        return jnp.dtype(json.load(f).get("dtype", "float32"))


def _restore_orbax(path: str, cfg: ModelConfig, dtype, sharding) -> dict:
    """Directories converted before the array store (an Orbax checkpoint under params/)."""
    import orbax.checkpoint as ocp

    stored = _stored_dtype(path)
    target = map_spec(lambda p, leaf: jax.ShapeDtypeStruct(leaf[0], leaf_dtype(leaf[1], stored), sharding=sharding),
                      param_spec(cfg))
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)), target)
    want = map_spec(lambda p, leaf: leaf_dtype(leaf[1], dtype), param_spec(cfg))
    return jax.tree.map(lambda x, d: x if x.dtype == d else x.astype(d), params, want)


def load_mtp(path: str | os.PathLike) -> dict:
    """The `mtp.*` tensors a `dsv4-convert` directory kept, by their checkpoint names (numpy;
    quantized ones of a native conversion dequantized to float32)."""
    from convert import quant
    from convert.store import INDEX, StoreReader

    d = os.path.join(os.fspath(path), MTP_DIR)
    if not os.path.isdir(d):
        return {}
    if not os.path.isfile(os.path.join(d, INDEX)):
        import orbax.checkpoint as ocp

        from convert.cli import flatten_names

        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.restore(os.path.abspath(d))
        return {k: np.asarray(v) for k, v in flatten_names(tree).items()}
    import ml_dtypes

    reader = StoreReader(d)
    out = {}
    for name, meta in reader.leaves.items():
        if meta["kind"] == "fp8":
            out[name] = quant.dequantize_fp8(reader.read(f"{name}/values"), reader.read(f"{name}/scale"))
        elif meta["kind"] == "fp4":
            out[name] = quant.dequantize_fp4(reader.read(f"{name}/values").view(np.int8),
                                             reader.read(f"{name}/scale").view(ml_dtypes.float8_e8m0fnu))
        else:
            out[name] = reader.read(name)
    return out
