"""`load(path)`: a model from a checkpoint directory."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .model import Model


def load(path: str | os.PathLike, dtype=jnp.float32) -> Model:
    """Loads the model in `path`, a directory holding `config.json` and an HF safetensors
    checkpoint (single file or sharded with `model.safetensors.index.json`; official or
    transformers naming). `dtype` is the compute dtype of the weights (float32 or bfloat16);
    norms, hyper-connections, sinks, `ape`, gate and compressor weights stay in float32."""
    from convert import read_hf_checkpoint

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg = ModelConfig.from_hf(path)
    params, _mtp = read_hf_checkpoint(path, cfg, dtype)
    return Model(params=jax.tree.map(jnp.asarray, params), config=cfg)
