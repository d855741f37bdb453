"""`load(path)`: a model from a checkpoint directory (HF safetensors, or our converted Orbax one)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .model import Model
from .params import leaf_dtype, map_spec, param_spec

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


def load(path: str | os.PathLike, dtype=jnp.float32, sharding: jax.sharding.Sharding | None = None) -> Model:
    """Loads the model in `path`: either a directory written by `dsv4-convert` (config.json plus
    an Orbax checkpoint under `params/`), or an HF checkpoint directory holding `config.json` and
    safetensors (single file or sharded with `model.safetensors.index.json`; official or
    transformers naming; float, FP8 or FP4 weights, dequantized on the fly). `dtype` is the
    compute dtype of the weights (float32 or bfloat16); norms, hyper-connections, sinks, `ape`,
    gate and compressor weights stay in float32. `sharding`, when given, is applied to every leaf
    (e.g. a NamedSharding on a mesh, replicated)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg = ModelConfig.from_hf(path)
    if is_converted(path):
        return Model(params=_restore(path, cfg, dtype, sharding), config=cfg)
    from convert import read_hf_checkpoint

    params, _mtp = read_hf_checkpoint(path, cfg, dtype)
    put = (lambda x: jax.device_put(x, sharding)) if sharding is not None else jnp.asarray
    return Model(params=jax.tree.map(put, params), config=cfg)


def _stored_dtype(path: str):
    with open(os.path.join(path, "config.json")) as f:
        return jnp.dtype(json.load(f).get("dtype", "float32"))


def _restore(path: str, cfg: ModelConfig, dtype, sharding) -> dict:
    import orbax.checkpoint as ocp

    stored = _stored_dtype(path)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = map_spec(lambda p, leaf: jax.ShapeDtypeStruct(leaf[0], leaf_dtype(leaf[1], stored), sharding=sharding),
                      param_spec(cfg))
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)), target)
    want = map_spec(lambda p, leaf: leaf_dtype(leaf[1], dtype), param_spec(cfg))
    return jax.tree.map(lambda x, d: x if x.dtype == d else x.astype(d), params, want)


def load_mtp(path: str | os.PathLike) -> dict:
    """The `mtp.*` tensors a `dsv4-convert` directory kept, by their checkpoint names (numpy)."""
    import numpy as np
    import orbax.checkpoint as ocp

    from convert.cli import flatten_names

    d = os.path.join(os.fspath(path), MTP_DIR)
    if not os.path.isdir(d):
        return {}
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(os.path.abspath(d))
    return {k: np.asarray(v) for k, v in flatten_names(tree).items()}
