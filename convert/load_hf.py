"""An HF safetensors checkpoint (either naming, float dtypes) -> our parameter tree."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4_jax.config import ModelConfig
from dsv4_jax.params import INT, is_spec_leaf, leaf_dtype, map_spec, param_spec

from .names import checkpoint_layout, is_mtp, official_name
from .safetensors_io import CheckpointError, iter_tensors

log = logging.getLogger("dsv4_jax")

_QUANT_SUFFIXES = (".scale", ".weight_scale_inv")


def _spec_at(spec, path):
    for k in path:
        spec = spec[k]
    assert is_spec_leaf(spec)
    return spec


def read_hf_checkpoint(directory: str, cfg: ModelConfig, dtype=jnp.float32) -> tuple[dict, dict]:
    """Reads every tensor of the main model into freshly allocated host arrays.

    Returns (params as numpy arrays in their target dtypes, the `mtp.*` tensors kept aside).
    A tensor that is missing, unexpected or of the wrong shape raises CheckpointError naming it.
    """
    spec = param_spec(cfg)
    layout = checkpoint_layout(cfg)
    np_dtype = {jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16}
    buffers = map_spec(lambda path, leaf: np.empty(
        leaf[0], np_dtype.get(leaf_dtype(leaf[1], dtype), leaf_dtype(leaf[1], dtype))), spec)
    seen: set[str] = set()
    mtp: dict[str, np.ndarray] = {}
    for name, arr, path in iter_tensors(directory):
        if is_mtp(name):
            mtp[name] = np.array(arr)
            continue
        if name.endswith(_QUANT_SUFFIXES) or arr.dtype in (ml_dtypes.float8_e4m3fn, np.int8):
            raise CheckpointError(
                f"{path}: tensor {name!r} is quantized (FP8/FP4); convert the checkpoint with "
                f"`dsv4-convert` first")
        official = official_name(name)
        if official not in layout:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (not part of this model's config)")
        if official in seen:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice in the checkpoint")
        seen.add(official)
        leaf_path, index = layout[official]
        shape, kind = _spec_at(spec, leaf_path)
        expected = tuple(shape[len(index):])
        if tuple(arr.shape) != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(arr.shape)}, the config expects {list(expected)}")
        target = buffers
        for k in leaf_path:
            target = target[k]
        if kind == INT:
            if arr.min(initial=0) < 0 or arr.max(initial=0) >= cfg.n_routed_experts:
                raise CheckpointError(f"{path}: tensor {name!r} holds expert ids outside [0, {cfg.n_routed_experts})")
        target[index] = arr.astype(np.float32).astype(target.dtype) if kind != INT else arr
    missing = [n for n in layout if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{directory}: missing tensors {missing[:5]}{more}")
    if mtp:
        log.info("kept %d mtp.* tensors aside (multi-token prediction is not used for decoding)", len(mtp))
    return buffers, mtp
