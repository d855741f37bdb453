"""`load(path)`: a model from a checkpoint directory (HF safetensors, or our converted one)."""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.model import mtp, sharding as sh
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.blocks import MTPBlock
from dsv4_jax.model.deepseek_v4 import DeepseekV4, with_options
from dsv4_jax.model.params import _get, leaf_dtype, map_spec, param_spec
from dsv4_jax.model.quantized import QuantizedWeight, storage_shapes
from dsv4_jax.model.sharding import matrix_axes
from .load_hf import MTP, read_hf_checkpoint
from .safetensors_io import CheckpointError
from .store import FORMAT, METADATA, read_custom_metadata

PARAMS_DIR = "params"
MTP_DIR = "mtp"


def _converted_config(path: str) -> bool:
    """Whether `path`/config.json is one `dsv4-convert` wrote."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return "dsv4_jax" in json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def is_converted(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `dsv4-convert`."""
    path = os.fspath(path)
    return os.path.isdir(os.path.join(path, PARAMS_DIR)) and _converted_config(path)


def load(path: str | os.PathLike, dtype=jnp.float32,
         sharding: jax.sharding.Sharding | Callable[[str, tuple], jax.sharding.Sharding] | None = None,
         mesh: jax.sharding.Mesh | None = None, layout=None, mtp: bool = False, **options) -> DeepseekV4:
    """Loads the model in `path`: either a directory written by `dsv4-convert` (config.json plus
    the Orbax checkpoint `params/`, restored through Orbax), or an HF checkpoint directory holding `config.json` and
    safetensors (single file or sharded with `model.safetensors.index.json`; official or
    transformers naming; float, FP8 or FP4 weights, dequantized on the fly). `dtype` is the
    compute dtype of the weights (float32 or bfloat16); norms, hyper-connections, sinks and `ape`
    stay in float32 (the head, gate and compressor weights are held in `dtype` and multiplied in
    float32, model/params.py). A `--dtype native` conversion's FP8/FP4 leaves come back as
    `QuantizedWeight`s (stored values and scales, `dtype` as their compute dtype), dequantized
    inside the matmuls. `sharding`, when given, is either one Sharding for every
    array (e.g. a NamedSharding on a mesh) or a function (dotted tree path, stored shape) ->
    Sharding, asked once per stored array (a QuantizedWeight's `values` and `scale` apart, as
    `layers.ffn.w1.values`), e.g. to split the routed experts over a mesh axis; each device
    reads only its own shard from disk (a converted directory; an HF one is read whole, then
    placed).
    `mesh` (a `jax.sharding.Mesh` with axes among data, expert, tensor) puts the model on a device
    mesh: every array is read straight onto its sharding under `layout` (a preset name of
    dsv4_jax/model/sharding.py, default "dp_attention", or a `sharding.Layout`; quantized weights split
    like their float forms), and the returned model's programs run on that mesh.
    `mtp=True` also loads the checkpoint's MTP block (`load_mtp_params`, on the mesh's devices
    under the layout like a main layer) into `model.mtp` (a `blocks.MTPBlock`), for speculative
    decoding. The model is a Flax NNX module (`DeepseekV4`; docs/design.md). On TPU v7 the weight
    stacks XLA's products read are moved to its product tiles (`sharding.product_tiled`).
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

        lay = sh.get_layout(layout)
        sh.check_divisible(cfg, mesh, lay)
        cfg = cfg.replace(layout=lay)
        sharding = sh.named_sharding_of(mesh, lay)
    elif layout is not None:
        raise ValueError("`layout` needs a `mesh`")
    model = DeepseekV4(sh.product_tiled(_params(path, cfg, dtype, sharding)), config=cfg)
    if mtp:
        model.mtp = MTPBlock(_load_mtp(path, cfg, dtype, mesh))
    model.mesh = mesh
    return model


def _params(path: str, cfg: ModelConfig, dtype, sharding) -> dict:
    if is_converted(path):
        return _restore(path, cfg, dtype, sharding)
    if _converted_config(path):
        raise _damaged(f"{os.path.join(path, PARAMS_DIR)} is missing: {path} is an incomplete dsv4-convert output; "
                       f"convert it again")

    params = read_hf_checkpoint(path, cfg, dtype)
    if sharding is None:
        return jax.tree.map(jnp.asarray, params)

    def put(p, x):
        return jax.device_put(x, _sharding_of(sharding, jax.tree_util.keystr(p, simple=True, separator="."), x.shape))

    return jax.tree_util.tree_map_with_path(put, params)


def _sharding_of(sharding, name: str, shape) -> jax.sharding.Sharding:
    return sharding(name, tuple(shape)) if callable(sharding) else sharding


def _damaged(message: str) -> Exception:
    return CheckpointError(message)


def _read_json(path: str, what: str) -> dict:
    """A JSON object file of the checkpoint; a missing or unreadable one is a CheckpointError
    naming it."""
    if not os.path.isfile(path):
        raise _damaged(f"{path} is missing: {what} is incomplete or damaged; convert it again")
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(f"{path} is damaged ({e}): convert it again") from None
    if not isinstance(obj, dict):
        raise _damaged(f"{path} is damaged (not a JSON object): convert it again")
    return obj


def _checkpoint_metadata(directory: str) -> dict:
    """The Orbax `_METADATA` of one of our checkpoint directories (params/, mtp/), checked
    before Orbax reads it: a directory of an earlier converter's array store, or one whose
    metadata is missing or unreadable, is a CheckpointError saying so."""
    old_index = os.path.join(directory, "index.json")
    if os.path.isfile(old_index) and not os.path.isfile(os.path.join(directory, METADATA)):
        try:
            with open(old_index) as f:
                fmt = json.load(f).get("format", "unknown")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            fmt = "unknown"
        raise _damaged(f"{os.path.dirname(directory)} was written by an earlier dsv4-convert (array store, "
                       f"format {fmt}), which this version does not read: convert it again")
    return _read_json(os.path.join(directory, METADATA), directory)


def _chunk_files(array_dir: str, meta: dict) -> tuple[list[str], int | None]:
    """The chunk files a zarr v3 array with a regular grid and the default key encoding has
    (a converted array writes every one), and their size when it is fixed (uncompressed, the
    `bytes` codec alone: a full chunk each) or None."""
    shape, chunk = meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]
    sep = meta.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/")
    grid = [-(-n // c) for n, c in zip(shape, chunk)]
    files = [os.path.join(array_dir, "c" + "".join(sep + str(i) for i in idx)) for idx in np.ndindex(*grid)]
    size = None
    if [c.get("name") for c in meta.get("codecs", [])] == ["bytes"]:
        try:
            size = int(np.prod(chunk, dtype=np.int64)) * jnp.dtype(meta["data_type"]).itemsize
        except TypeError:
            size = None
    return files, size


def _check_arrays(pdir: str, want: dict) -> None:
    """Every array the target asks for (`want`: tree path -> shape) is in the checkpoint
    written by our converter, with the expected shape and every chunk file whole: a missing or
    damaged one is a CheckpointError naming the array and the file. (Orbax itself would pad or
    truncate a misshapen array, and fail on a missing chunk with a TensorStore traceback.)"""
    for path, shape in want.items():
        name = ".".join(path)
        array_dir = os.path.join(pdir, name)
        zarr_json = os.path.join(array_dir, "zarr.json")
        if not os.path.isfile(zarr_json):
            raise _damaged(f"{pdir}: array {name!r} is missing ({zarr_json} not found); convert it again")
        meta = _read_json(zarr_json, f"array {name!r}")
        try:
            got = tuple(meta["shape"])
            files, size = _chunk_files(array_dir, meta)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise _damaged(f"{zarr_json} is damaged (not a zarr v3 array with a regular chunk grid): "
                           f"convert it again") from None
        if got != tuple(shape):
            raise _damaged(f"{pdir}: array {name!r} is {list(got)}, the config expects {list(shape)}")
        for f in files:
            try:
                n = os.path.getsize(f)
            except OSError:
                raise _damaged(f"{pdir}: array {name!r} is damaged: chunk file {f} is missing; convert it again") from None
            if size is not None and n != size:
                raise _damaged(f"{pdir}: array {name!r} is damaged: chunk file {f} has {n} bytes, not {size} "
                               f"(truncated?); convert it again")


def _check_tree(pdir: str, want: dict) -> None:
    """As _check_arrays, for an Orbax checkpoint not written by our converter (e.g. one Orbax
    itself saved): the shapes in Orbax's metadata."""
    import orbax.checkpoint as ocp  # here, not at import: it is most of dsv4_jax's import time

    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(pdir)
    meta = getattr(meta, "item_metadata", meta)
    meta = getattr(meta, "tree", meta)
    have = {tuple(str(getattr(k, "key", k)) for k in p): tuple(getattr(m, "shape", ()) or ())
            for p, m in jax.tree_util.tree_flatten_with_path(meta)[0]}
    for path, shape in want.items():
        got = have.get(path)
        if got is None or tuple(got) != tuple(shape):
            raise _damaged(f"{pdir}: array {'.'.join(path)!r} is {'missing' if got is None else list(got)}, "
                           f"the config expects {list(shape)}")


def _orbax_restore(directory: str, restore):
    """restore() (an Orbax restore of `directory`), any failure of Orbax / TensorStore as one
    CheckpointError line."""
    try:
        return restore()
    except Exception as e:  # Orbax and TensorStore raise many kinds; the caller gets one
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _damaged(f"{directory}: the checkpoint cannot be read ({first}); convert it again") from None


def _restore(path: str, cfg: ModelConfig, dtype, sharding) -> dict:
    """The params/ Orbax checkpoint restored by Orbax onto `sharding` (each device reads its
    own shard), the values / scale subtrees of a native conversion as QuantizedWeights."""
    return _restore_tree(os.path.join(path, PARAMS_DIR), param_spec(cfg), dtype, sharding, _quantized(path, PARAMS_DIR))


def _quantized(path: str, tree: str) -> dict[str, str]:
    """The leaves of `tree` (params/ or mtp/) a native conversion kept quantized, dotted path
    within that tree -> "fp8" | "fp4" (config.json's "quantized", where the MTP block's leaves
    are named as in `nnx.state(model)`: "mtp.attn.wq_a")."""
    quantized = _read_json(os.path.join(path, "config.json"), path).get("quantized") or {}
    mine = {k.removeprefix(MTP_DIR + "."): v for k, v in quantized.items() if k.startswith(MTP_DIR + ".")}
    return mine if tree == MTP_DIR else {k: v for k, v in quantized.items() if not k.startswith(MTP_DIR + ".")}


def _restore_tree(directory: str, spec: dict, dtype, sharding, quantized: dict[str, str],
                  axes_root: tuple = ()) -> dict:
    """One of our Orbax checkpoints (params/, mtp/) restored by Orbax as the tree `spec`
    describes, onto `sharding` (one Sharding, a function (dotted name, stored shape) -> Sharding,
    or None: the first device), `quantized`'s leaves as QuantizedWeights. `axes_root` is put
    before a leaf's path to name its axes (the MTP block's leaves are a main layer's)."""
    import orbax.checkpoint as ocp  # here, not at import: it is most of dsv4_jax's import time

    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pdir = os.path.abspath(directory)
    root = ".".join(axes_root + ("",)) if axes_root else ""
    want: dict[tuple, tuple] = {}

    def target(p, spec_leaf):
        shape, cls = spec_leaf
        fmt = quantized.get(".".join(p))
        if fmt is not None:
            parts = storage_shapes(tuple(shape), fmt)
            want.update({p + (k,): s for k, (s, _) in parts.items()})
            return {k: jax.ShapeDtypeStruct(s, d, sharding=_sharding_of(sharding, root + ".".join(p + (k,)), s))
                    for k, (s, d) in parts.items()}
        want[p] = tuple(shape)
        return jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(cls, dtype),
                                    sharding=_sharding_of(sharding, root + ".".join(p), shape))

    tgt = map_spec(target, spec)
    custom = _checkpoint_metadata(pdir).get("custom_metadata")
    if isinstance(custom, dict) and custom.get("format") == FORMAT:
        _check_arrays(pdir, want)
    else:
        _check_tree(pdir, want)

    def restore():
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(pdir, tgt)

    tree = _orbax_restore(pdir, restore)

    def build(p, spec_leaf):
        node = _get(tree, p)
        fmt = quantized.get(".".join(p))
        if fmt is not None:
            return QuantizedWeight(node["values"], node["scale"], fmt=fmt, dtype_name=jnp.dtype(dtype).name,
                                   axes=matrix_axes(axes_root + p))
        return node

    return map_spec(build, spec)


def load_mtp_params(path: str | os.PathLike, dtype=jnp.float32) -> dict:
    """The multi-token-prediction block `mtp.0` of the checkpoint in `path` as the parameter tree
    of dsv4_jax/model/mtp.py (`mtp.mtp_param_spec`: what `nnx.state(model.mtp)` holds; run it with
    `mtp.mtp_step`, beside the model `load(path)` gives: the block shares its embed and head).

    `path` is read as `load` reads it: a `dsv4-convert` directory (its `mtp/`, the same tree) or
    an HF checkpoint directory (official names, with or without a leading `model.`). `dtype` is
    the compute dtype of the weights; norms, hyper-connections and the sink stay float32 (the
    gate is held in `dtype` and multiplied in float32). From a `--dtype native` conversion the
    leaves mtp.NATIVE_QUANT names that the checkpoint stores quantized come back as
    `QuantizedWeight`s (stored values and scales, dequantized inside the matmuls), as `load` does
    for the main layers: e_proj, h_proj and the attention and shared-expert linears FP8, the
    routed experts FP4; attn.wo_a is dequantized (as the main layers'). From an HF directory
    every weight is dequantized exactly to `dtype`.

    Raises CheckpointError naming the problem for a checkpoint without MTP tensors, for a
    missing, unexpected, duplicated or misshapen one, and for an `mtp/` an earlier dsv4-convert
    wrote (by checkpoint names)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    return _load_mtp(path, ModelConfig.from_hf(path), dtype, None)


def _load_mtp(path: str, cfg: ModelConfig, dtype, mesh) -> dict:
    """load_mtp_params, on `mesh` under cfg.layout when given (each leaf split as a main layer's)."""
    def none():
        return CheckpointError(f"{path}: the checkpoint has no MTP tensors (mtp.0.*; its config says "
                               f"num_nextn_predict_layers {cfg.num_nextn_predict_layers})")

    if is_converted(path):
        d = os.path.join(path, MTP_DIR)
        if not os.path.isdir(d):
            raise none()
        leaves = (read_custom_metadata(d) or {}).get("leaves", {})
        if any(k.startswith(mtp.PREFIX) for k in leaves):
            raise _damaged(f"{d} holds the MTP tensors by checkpoint name (an earlier dsv4-convert); this version "
                           f"stores the block's state tree: convert it again")
        sharding = None if mesh is None else sh.named_sharding_of(mesh, cfg.layout)
        return _restore_tree(d, mtp.mtp_param_spec(cfg), dtype, sharding, _quantized(path, MTP_DIR),
                             axes_root=("layers",))
    block = read_hf_checkpoint(path, cfg, dtype, tree=MTP)
    if not block:
        raise none()
    block = jax.tree.map(jnp.asarray, block)
    return block if mesh is None else jax.device_put(block, sh.mtp_shardings(block, mesh, cfg.layout))
