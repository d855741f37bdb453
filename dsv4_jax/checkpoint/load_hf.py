"""An HF safetensors checkpoint (either naming; float, FP8 or FP4 weights) -> our parameter tree.

Two passes. `plan_checkpoint` reads every shard's header (names -> file, dtype, shape, offsets),
so a weight's `.scale` / `.weight_scale_inv` companion is found whatever shard holds it, and
checks everything a header can tell (unexpected, duplicate, missing or misshapen tensors,
quantized weights without a valid scale, dtypes) before any data is read. `iter_sources` then
streams the tensors one at a time (a quantized weight together with its scale, as a `Source`),
checking what only the data can tell (NaN scales, expert ids). `read_hf_checkpoint` fills a
parameter tree from them, dequantized exactly (dsv4_jax/checkpoint/quant.py) and rounded once to the target
dtype; the converter (convert/cli.py) writes them to disk as they come instead. The MTP block's
`mtp.*` tensors are planned and checked with the rest and placed under "mtp" in the block's own
tree (mtp.mtp_param_spec), as `nnx.state(model)` holds it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4_jax.model import mtp
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.params import INT, is_spec_leaf, leaf_dtype, map_spec, param_spec
from . import quant
from .names import checkpoint_layout, is_mtp, mtp_checkpoint_layout, official_name
from .safetensors_io import CheckpointError, TensorEntry, read_tensor, scan_checkpoint

_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_QUANT_DTYPES = ("F8_E4M3", "I8")
MTP = "mtp"  # the MTP block's subtree in a plan's spec, as in `nnx.state(model)`


def _spec_at(spec, path):
    for k in path:
        spec = spec[k]
    assert is_spec_leaf(spec)
    return spec


def _np_dtype(dtype):
    d = jnp.dtype(dtype)
    return ml_dtypes.bfloat16 if d == jnp.dtype(jnp.bfloat16) else d


def scale_name_of(name: str, entries) -> str | None:
    """The companion scale tensor of a weight, if the checkpoint has one."""
    if name.endswith(".weight"):
        for cand in (name[: -len(".weight")] + ".scale", name + "_scale_inv"):
            if cand in entries:
                return cand
    return None


def _weight_of_scale(name: str) -> str:
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_scale_inv")]
    return name[: -len(".scale")] + ".weight"


class Source(NamedTuple):
    """One checkpoint tensor as stored: fmt "fp8" (e4m3 values, float32 scale values), "fp4" (I8
    packed values, E8M0 scale bytes as uint8) or "raw" (the array as stored, scale None)."""

    fmt: str
    data: np.ndarray
    scale: np.ndarray | None

    def dense(self, dtype) -> np.ndarray:
        """Dequantized (or cast) to dtype: float32 products, one rounding."""
        dtype = _np_dtype(dtype)
        if self.fmt == "fp8":
            return quant.dequantize_fp8(self.data, self.scale, dtype)
        if self.fmt == "fp4":
            return quant.dequantize_fp4(self.data, self.scale.view(ml_dtypes.float8_e8m0fnu), dtype)
        arr = self.data
        if arr.dtype == dtype:
            return arr
        if np.dtype(dtype).kind in "iu":
            return arr.astype(dtype)
        return arr.astype(np.float32).astype(dtype)


def check_tensor(name: str, entries: dict[str, TensorEntry]) -> str:
    """Header checks of one tensor and its scale; returns its format ("fp8", "fp4" or "raw")."""
    entry = entries[name]
    sname = scale_name_of(name, entries)
    if sname is None:
        if entry.dtype in _QUANT_DTYPES:
            raise CheckpointError(
                f"{entry.path}: tensor {name!r} is quantized ({entry.dtype}) but has no scale tensor "
                f"(expected {name[:-len('.weight')] + '.scale'!r} or {name + '_scale_inv'!r})")
        return "raw"
    sentry = entries[sname]
    if sentry.dtype not in ("F8_E8M0", "F32", "BF16", "F16"):
        raise CheckpointError(f"{sentry.path}: scale tensor {sname!r} has unsupported dtype {sentry.dtype}")
    if entry.dtype == "F8_E4M3":
        kind, expected = "FP8", quant.fp8_scale_shape(entry.shape) if len(entry.shape) == 2 else None
    elif entry.dtype == "I8":
        if sentry.dtype != "F8_E8M0":
            raise CheckpointError(f"{sentry.path}: FP4 scale {sname!r} must be F8_E8M0, got {sentry.dtype}")
        kind = "FP4"
        expected = quant.fp4_scale_shape(entry.shape) if len(entry.shape) == 2 else None
    else:
        raise CheckpointError(f"{entry.path}: tensor {name!r} has a scale {sname!r} but dtype {entry.dtype} "
                              f"is not a quantized format (F8_E4M3 or I8-packed FP4)")
    if expected is None or sentry.shape != tuple(expected):
        raise CheckpointError(
            f"{sentry.path}: scale {sname!r} has shape {list(sentry.shape)}, {kind} weight {name!r} of shape "
            f"{list(entry.shape)} needs {list(expected) if expected else '2-D weight'}")
    return kind.lower()


def read_source(name: str, entries: dict[str, TensorEntry]) -> Source:
    """One tensor (and its scale) as a Source; raw data are memory-map views."""
    fmt = check_tensor(name, entries)
    entry = entries[name]
    if fmt == "raw":
        return Source("raw", read_tensor(entry), None)
    sname = scale_name_of(name, entries)
    sentry = entries[sname]
    scale = np.array(read_tensor(sentry))
    if sentry.dtype == "F8_E8M0" and (scale.view(np.uint8) == 255).any():
        raise CheckpointError(f"{sentry.path}: scale {sname!r} holds NaN (E8M0 byte 255)")
    if fmt == "fp8":
        return Source("fp8", read_tensor(entry), quant.scale_values(scale))
    return Source("fp4", read_tensor(entry), scale.view(np.uint8))


def dequantized_shape(name: str, entries) -> tuple[int, ...]:
    e = entries[name]
    if e.dtype == "I8" and scale_name_of(name, entries) is not None and len(e.shape) == 2:
        return (e.shape[0], 2 * e.shape[1])
    return e.shape


def source_kind(name: str, entries) -> str:
    """"fp8" (E8M0 scales), "fp8:float-scale", "fp4", or the stored dtype name ("BF16", "F32", ...)
    of a checked tensor."""
    e = entries[name]
    sname = scale_name_of(name, entries)
    if sname is None:
        return e.dtype
    if e.dtype == "I8":
        return "fp4"
    return "fp8" if entries[sname].dtype == "F8_E8M0" else "fp8:float-scale"


def tensor_nbytes(name: str, entries) -> int:
    sname = scale_name_of(name, entries)
    return entries[name].nbytes + (entries[sname].nbytes if sname is not None else 0)


@dataclasses.dataclass
class Plan:
    """What a checkpoint holds for a config, header-checked (see `plan_checkpoint`)."""

    directory: str
    cfg: ModelConfig
    entries: dict[str, TensorEntry]
    spec: dict  # param_spec, and under "mtp" the MTP block's (mtp.mtp_param_spec) when it has one
    todo: list[tuple[str, tuple, tuple]]  # (name, leaf path, stacked index); an MTP leaf's path starts "mtp"
    sources: dict[tuple, set]  # leaf path -> source kinds of its tensors
    total_bytes: int

    @property
    def has_mtp(self) -> bool:
        return MTP in self.spec

    def part(self, tree: str) -> "Plan":
        """The plan of the main model's tensors (tree "params") or of the MTP block's ("mtp")."""
        keep = [t for t in self.todo if (t[1][0] == MTP) == (tree == MTP)]
        return dataclasses.replace(self, todo=keep, total_bytes=sum(tensor_nbytes(n, self.entries) for n, _, _ in keep))


def plan_checkpoint(directory: str, cfg: ModelConfig, *, skip_layers_from: int | None = None) -> Plan:
    """Reads the headers and checks every tensor against the config without reading any data:
    the main model's (names.checkpoint_layout) and, when the checkpoint has any `mtp.*` tensor,
    the whole MTP block's (names.mtp_checkpoint_layout, placed under "mtp"). A tensor that is
    missing, unexpected or of the wrong shape or dtype, or a quantized weight without a valid
    scale, raises CheckpointError naming it."""
    entries = scan_checkpoint(directory)
    spec = param_spec(cfg)
    layout = checkpoint_layout(cfg)
    names = []
    for name, entry in entries.items():
        if name.endswith(_SCALE_SUFFIXES):
            if _weight_of_scale(name) not in entries:
                raise CheckpointError(f"{entry.path}: unexpected tensor {name!r} (a scale without its weight "
                                      f"{_weight_of_scale(name)!r})")
            continue
        if skip_layers_from is not None:
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= skip_layers_from:
                continue
        names.append(name)
    if any(is_mtp(n) for n in names):
        spec[MTP] = mtp.mtp_param_spec(cfg)
        layout.update({name: ((MTP,) + path, index) for name, (path, index) in mtp_checkpoint_layout(cfg).items()})

    todo = []
    sources: dict[tuple, set] = {}
    seen: set[str] = set()
    total = 0
    for name in names:
        entry = entries[name]
        path = entry.path
        total += tensor_nbytes(name, entries)
        official = official_name(name)
        if official not in layout:
            what = ("MTP tensor", "not part of the block mtp.0 this config describes") if is_mtp(name) else \
                ("tensor", "not part of this model's config")
            raise CheckpointError(f"{path}: unexpected {what[0]} {name!r} ({what[1]})")
        if official in seen:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice in the checkpoint")
        seen.add(official)
        leaf_path, index = layout[official]
        shape, kind = _spec_at(spec, leaf_path)
        expected = tuple(shape[len(index):])
        got = dequantized_shape(name, entries)
        if tuple(got) != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(got)}, the config expects {list(expected)}")
        if kind == INT:
            if entry.dtype not in ("I64", "I32", "I16", "U8", "I8"):
                raise CheckpointError(f"{path}: tensor {name!r} must hold integers, got {entry.dtype}")
        else:
            if entry.dtype in ("I64", "I32", "I16", "U8", "BOOL") or (
                    entry.dtype == "I8" and scale_name_of(name, entries) is None):
                if entry.dtype == "I8":
                    check_tensor(name, entries)  # raises: quantized without scale
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry.dtype}, a float is expected")
            check_tensor(name, entries)
        sources.setdefault(leaf_path, set()).add(source_kind(name, entries))
        todo.append((name, leaf_path, index))
    missing = [n for n in layout if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        what = "MTP tensors" if all(is_mtp(n) for n in missing) else "tensors"
        raise CheckpointError(f"{directory}: missing {what} {missing[:5]}{more}")
    return Plan(directory, cfg, entries, spec, todo, sources, total)


def iter_sources(plan: Plan, progress: Callable[..., None] | None = None
                 ) -> Iterator[tuple[str, tuple | None, tuple, Source]]:
    """Yields (name, leaf path, stacked index, Source) one tensor at a time, in checkpoint order. `progress(done, total, bytes_read, total_bytes)` follows each."""
    entries, cfg = plan.entries, plan.cfg
    nbytes = 0
    for done, (name, leaf_path, index) in enumerate(plan.todo, 1):
        entry = entries[name]
        src = read_source(name, entries)
        if _spec_at(plan.spec, leaf_path)[1] == INT:
            arr = src.data
            if arr.min(initial=0) < 0 or arr.max(initial=0) >= cfg.n_routed_experts:
                raise CheckpointError(
                    f"{entry.path}: tensor {name!r} holds expert ids outside [0, {cfg.n_routed_experts})")
        yield name, leaf_path, index, src
        nbytes += tensor_nbytes(name, entries)
        if progress is not None:
            progress(done, len(plan.todo), nbytes, plan.total_bytes)


def read_hf_checkpoint(directory: str, cfg: ModelConfig, dtype=jnp.float32, *, tree: str = "params",
                       skip_layers_from: int | None = None, progress: Callable[..., None] | None = None) -> dict:
    """Reads every tensor of the main model (`tree="params"`: the parameter tree) or of its MTP
    block (`tree="mtp"`: mtp.mtp_param_spec's tree, {} when the checkpoint has none) into freshly
    allocated host arrays in their target dtypes, dequantized exactly. The whole checkpoint is
    checked first (`plan_checkpoint`): a tensor that is missing, unexpected or of the wrong shape,
    or a quantized weight without its scale, raises CheckpointError naming it.
    `skip_layers_from=N` ignores the tensors of main layers >= N (cfg must then describe N
    layers). `progress(done, total, bytes_read, total_bytes)` is called after each tensor.
    """
    plan = plan_checkpoint(directory, cfg, skip_layers_from=skip_layers_from)
    if tree == MTP and not plan.has_mtp:
        return {}
    spec = plan.spec[MTP] if tree == MTP else {k: v for k, v in plan.spec.items() if k != MTP}
    buffers = map_spec(lambda path, leaf: np.empty(leaf[0], _np_dtype(leaf_dtype(leaf[1], dtype))), spec)
    for name, leaf_path, index, src in iter_sources(plan.part(tree), progress):
        target = buffers
        for k in leaf_path[1:] if tree == MTP else leaf_path:
            target = target[k]
        target[index] = src.dense(target.dtype)  # fp32 leaves dequantize to fp32
    return buffers
