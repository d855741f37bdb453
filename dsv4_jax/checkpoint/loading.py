"""`load(path)`: a model from a checkpoint directory (HF safetensors, or our converted one)."""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4_jax.model import mtp, sharding as sh
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.blocks import MTPBlock
from dsv4_jax.model.deepseek_v4 import DeepseekV4, with_options
from dsv4_jax.model.params import _get, leaf_dtype, map_spec, param_spec
from dsv4_jax.model.quantized import QuantizedWeight, storage_shapes
from dsv4_jax.model.sharding import matrix_axes
from .load_hf import Source, read_hf_checkpoint, read_source
from .names import is_mtp, mtp_checkpoint_layout
from .safetensors_io import CheckpointError, scan_checkpoint
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
    dsv4_jax/model/sharding.py, default "dp_attention", or a `sharding.Layout`; quantized weights split
    like their float forms), and the returned model's programs run on that mesh.
    `mtp=True` also loads the checkpoint's MTP block (`load_mtp_params`, on the mesh's devices
    under the layout like a main layer) into `model.mtp` (a `blocks.MTPBlock`), for speculative
    decoding. The model is a Flax NNX module (`DeepseekV4`; docs/design.md).
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
    model = _load(path, cfg, dtype, sharding)
    if mtp:
        block = load_mtp_params(path, dtype)
        if mesh is not None:
            block = jax.device_put(block, sh.mtp_shardings(block, mesh, cfg.layout))
        model.mtp = MTPBlock(block)
    model.mesh = mesh
    return model


def _load(path: str, cfg: ModelConfig, dtype, sharding) -> DeepseekV4:
    if is_converted(path):
        return DeepseekV4(_restore(path, cfg, dtype, sharding), config=cfg)
    if _converted_config(path):
        raise _damaged(f"{os.path.join(path, PARAMS_DIR)} is missing: {path} is an incomplete dsv4-convert output; "
                       f"convert it again")

    params, _mtp = read_hf_checkpoint(path, cfg, dtype)
    if sharding is None:
        return DeepseekV4(jax.tree.map(jnp.asarray, params), config=cfg)

    def put(p, x):
        return jax.device_put(x, _sharding_of(sharding, jax.tree_util.keystr(p, simple=True, separator="."), x.shape))

    return DeepseekV4(jax.tree_util.tree_map_with_path(put, params), config=cfg)


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
    import orbax.checkpoint as ocp  # here, not at import: it is most of dsv4_jax's import time

    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pdir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    quantized = _read_json(os.path.join(path, "config.json"), path).get("quantized") or {}
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
    custom = _checkpoint_metadata(pdir).get("custom_metadata")
    if isinstance(custom, dict) and custom.get("format") == FORMAT:
        _check_arrays(pdir, want)
    else:
        _check_tree(pdir, want)

    def restore():
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(pdir, tgt)

    params = _orbax_restore(pdir, restore)

    def build(p, spec_leaf):
        node = params
        for k in p:
            node = node[k]
        fmt = quantized.get(".".join(p))
        if fmt is not None:
            return QuantizedWeight(node["values"], node["scale"], fmt=fmt, dtype_name=jnp.dtype(dtype).name,
                                   axes=matrix_axes(p))
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


def _converted_mtp_sources(path: str) -> dict:
    """The `mtp.*` tensors a `dsv4-convert` directory kept (the Orbax checkpoint `mtp/`), by their
    checkpoint names, as `dsv4_jax.checkpoint.load_hf.Source`s: "raw" (the stored array), or, from a native
    conversion, "fp8" (e4m3 values, float32 scale values) / "fp4" (packed values, E8M0 scale
    bytes). {} without an `mtp/`."""
    import orbax.checkpoint as ocp  # here, not at import: it is most of dsv4_jax's import time

    d = os.path.abspath(os.path.join(path, MTP_DIR))
    if not os.path.isdir(d):
        return {}
    _checkpoint_metadata(d)
    leaves = (read_custom_metadata(d) or {}).get("leaves", {})

    def restore():
        with ocp.PyTreeCheckpointer() as ckptr:
            return ckptr.restore(d)

    tree = _orbax_restore(d, restore)
    out = {}
    for name, v in _flatten_mtp(tree, leaves).items():
        kind = leaves.get(name, {}).get("kind")
        if kind == "fp8":
            out[name] = Source("fp8", np.asarray(v["values"]), np.asarray(v["scale"]))
        elif kind == "fp4":
            out[name] = Source("fp4", np.asarray(v["values"]).view(np.int8), np.asarray(v["scale"]).view(np.uint8))
        else:
            out[name] = Source("raw", np.asarray(v), None)
    return out


def load_mtp(path: str | os.PathLike) -> dict:
    """The `mtp.*` tensors a `dsv4-convert` directory kept (the Orbax checkpoint `mtp/`), by
    their checkpoint names, as numpy arrays (quantized ones of a native conversion dequantized
    to float32)."""
    return {name: src.data if src.fmt == "raw" else src.dense(np.float32)
            for name, src in _converted_mtp_sources(os.fspath(path)).items()}


def _hf_mtp_sources(path: str) -> dict:
    """The `mtp.*` tensors of an HF checkpoint directory as `dsv4_jax.checkpoint.load_hf.Source`s (a quantized
    weight with its scale, header-checked: dsv4_jax.checkpoint.load_hf.check_tensor)."""
    entries = scan_checkpoint(path)
    out = {}
    for name, entry in entries.items():
        if not is_mtp(name):
            continue
        if name.endswith((".scale", ".weight_scale_inv")):
            weight = name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name[: -len("_scale_inv")]
            if weight not in entries:
                raise CheckpointError(f"{entry.path}: unexpected tensor {name!r} (a scale without its weight "
                                      f"{weight!r})")
            continue
        out[name] = read_source(name, entries)
    return out


def load_mtp_params(path: str | os.PathLike, dtype=jnp.float32) -> dict:
    """The multi-token-prediction block `mtp.0` of the checkpoint in `path` as the parameter tree
    of dsv4_jax/model/mtp.py (run it with `mtp.mtp_step`, beside the model `load(path)` gives: the block
    shares its embed and head).

    `path` is read as `load` reads it: a `dsv4-convert` directory (its `mtp/`) or an HF checkpoint
    directory (official names, with or without a leading `model.`). `dtype` is the compute dtype
    of the weights; norms, hyper-connections, the sink and the gate stay float32. From a `--dtype
    native` conversion the leaves mtp.NATIVE_QUANT names that the checkpoint stores quantized
    come back as `QuantizedWeight`s (stored values and scales, dequantized inside the matmuls),
    as `load` does for the main layers: e_proj, h_proj and the attention and shared-expert
    linears FP8, the routed experts FP4; attn.wo_a is dequantized (as the main layers'). From an
    HF directory every weight is dequantized exactly to `dtype`, as `load` does.

    Raises CheckpointError naming the problem for a checkpoint without MTP tensors, and for a
    missing, unexpected, duplicated or misshapen one."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg = ModelConfig.from_hf(path)
    converted = is_converted(path)
    sources = _converted_mtp_sources(path) if converted else _hf_mtp_sources(path)
    if not sources:
        raise CheckpointError(f"{path}: the checkpoint has no MTP tensors (mtp.0.*; its config says "
                              f"num_nextn_predict_layers {cfg.num_nextn_predict_layers})")
    return _mtp_tree(sources, cfg, dtype, path, keep_quantized=converted)


def _mtp_tree(sources: dict, cfg: ModelConfig, dtype, where: str, keep_quantized: bool) -> dict:
    """The block's tree from its tensors by checkpoint name (`dsv4_jax.checkpoint.load_hf.Source`s), each
    checked against names.mtp_checkpoint_layout / mtp.mtp_param_spec."""
    names = mtp_checkpoint_layout(cfg)
    spec = mtp.mtp_param_spec(cfg)
    parts: dict[tuple, dict[tuple, tuple]] = {}  # tree path -> {index: (name, Source)}
    for name, src in sources.items():
        official = name.removeprefix("model.")
        if official not in names:
            raise CheckpointError(f"{where}: unexpected MTP tensor {name!r} (not part of the block mtp.0 "
                                  f"this config describes)")
        path, index = names[official]
        if index in parts.get(path, {}):
            raise CheckpointError(f"{where}: MTP tensor {name!r} appears twice in the checkpoint")
        shape = tuple(_get(spec, path)[0][len(index):])
        got = tuple(src.data.shape)
        if src.fmt == "fp4":
            got = got[:-1] + (2 * got[-1],)
        if got != shape:
            raise CheckpointError(f"{where}: MTP tensor {name!r} has shape {list(got)}, the config expects "
                                  f"{list(shape)}")
        if src.fmt == "raw" and src.data.dtype.kind in "iub":
            raise CheckpointError(f"{where}: MTP tensor {name!r} has dtype {src.data.dtype}, a float is expected")
        if src.fmt != "raw":
            want = storage_shapes(shape, src.fmt)["scale"][0]
            if tuple(src.scale.shape) != tuple(want):
                raise CheckpointError(f"{where}: the scale of MTP tensor {name!r} has shape "
                                      f"{list(src.scale.shape)}, its {src.fmt.upper()} weight needs {list(want)}")
        parts.setdefault(path, {})[index] = (name, src)
    missing = [n for n, (path, index) in names.items() if index not in parts.get(path, {})]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing MTP tensors {missing[:5]}{more}")

    def build(path, leaf):
        indices = sorted(parts[path])
        items = [parts[path][i][1] for i in indices]

        def join(arrays):  # a routed-expert weight's experts stacked in id order, any other leaf as it is
            return arrays[0] if indices == [()] else np.stack(arrays)

        fmt = mtp.NATIVE_QUANT.get(path)
        if keep_quantized and fmt is not None and all(s.fmt == fmt for s in items):
            values = join([s.data.view(np.uint8) if fmt == "fp4" else s.data for s in items])
            return QuantizedWeight(jnp.asarray(values), jnp.asarray(join([s.scale for s in items])), fmt=fmt,
                                   dtype_name=jnp.dtype(dtype).name, axes=matrix_axes(("layers",) + path))
        target = leaf_dtype(leaf[1], dtype)
        return jnp.asarray(join([s.dense(ml_dtypes.bfloat16 if target == jnp.bfloat16 else target) for s in items]),
                           target)

    return map_spec(build, spec)
