"""Interleaved (GPT-J style) rotary embedding on the last `rope_head_dim` dims, with YaRN.

Window-only layers use `rope_theta` without YaRN; compressed layers (ratio 4 and 128) use
`compress_rope_theta` with YaRN frequency interpolation and no magnitude scaling.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig, Yarn


def inv_freq(rope_dim: int, base: float, yarn: Yarn | None) -> np.ndarray:
    """Inverse frequencies `[rope_dim // 2]` in float32, one per interleaved pair.

    Bit-identical to torch's float32 computation: `base ** (2i / d)` comes from XLA's CPU pow
    (numpy's float32 pow rounds some Flash pairs differently by 1 ulp, an angle error that grows
    with position); the rest are correctly rounded float32 operations in the reference's order."""
    # Evaluated now on the CPU, also when called while tracing a jitted function, and outside any
    # abstract mesh the trace runs under (dsv4-plan traces over compile-only devices).
    with (jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), jax.ensure_compile_time_eval(),
          jax.default_device(jax.devices("cpu")[0])):
        exponents = jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / jnp.float32(rope_dim)
        pos_freqs = np.asarray(jnp.power(jnp.float32(base), exponents))
    one = np.float32(1)
    extrapolation = one / pos_freqs
    if yarn is None:
        return extrapolation

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = one - ramp  # 1: the original frequency, 0: divided by the factor
    interpolation = one / (np.float32(yarn.factor) * pos_freqs)
    return (interpolation * (one - keep) + extrapolation * keep).astype(np.float32)


def layer_inv_freqs(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(window-only layers' inv_freq, compressed layers' inv_freq), each `[rope_head_dim // 2]`."""
    return (inv_freq(cfg.rope_head_dim, cfg.rope_theta, None),
            inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn))


def cos_sin(positions: jnp.ndarray, freqs: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin `[..., rope/2]` (float32) of the angles `positions * freqs`, rounded to fp32 first."""
    angles = positions.astype(jnp.float32)[..., None] * freqs.astype(jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)
