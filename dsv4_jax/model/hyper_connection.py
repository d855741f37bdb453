"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

Each sub-layer (attention, MoE) reads one collapsed stream (`pre` weights), and writes back
`post * f + comb^T @ streams`, where `comb` is made doubly stochastic by Sinkhorn iterations.
All mixing weights are computed in fp32. The two passes over the streams are
`pallas_kernels.hc_collapse` and `hc_expand` (Mosaic kernels on TPU, given the model's config);
on XLA:CPU their plain-JAX references, the mixes' product by `dense`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

import pallas_kernels  # looked up at call time: pallas_kernels imports our primitives
from . import xla_cpu
from .config import ModelConfig
from .layer_weights import LayerSlice, own_weight
from .linear import dense
from .sharding import BATCH, per_device

_STREAMS = (BATCH, None, None, None)
_ROWS = (BATCH, None, None)


def sinkhorn(logits: jnp.ndarray, iters: int, eps: float) -> jnp.ndarray:
    """`[..., hc, hc]` logits -> row softmax + eps, a column normalisation, then `iters - 1`
    (row, column) rounds: ends on a column normalisation."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, c)


def _collapse(x, fn, base, scale, hc_eps: float, norm_eps: float, cfg: ModelConfig | None):
    """`pallas_kernels.hc_collapse` (per device on the model's mesh; its attention_impl choice,
    the reference without cfg), a layer's fn (a LayerSlice) read in place in its stack; on CPU
    the reference with the product by `dense`, whose fn may be a per-layer buffer."""
    kw = dict(hc_eps=hc_eps, norm_eps=norm_eps)

    def device(x, fn, base, scale):
        stack, layer = (fn.stack, fn.index) if isinstance(fn, LayerSlice) else (fn, None)
        run = partial(pallas_kernels.hc_collapse, impl="ref" if cfg is None else cfg.attention_impl, **kw)
        if cfg is not None:
            run = per_device(cfg, run, (_STREAMS, None, None, None, None), _ROWS)
        return run(x, stack, base, scale, layer)

    def cpu(x, fn, base, scale):
        return pallas_kernels.hc_collapse_ref(x, own_weight(fn), base, scale, product=dense, **kw)

    return xla_cpu.choose(x, fn, base, scale, cpu=cpu, device=device)


def hc_pre(x: jnp.ndarray, fn: jnp.ndarray, base: jnp.ndarray, scale: jnp.ndarray, *, hc: int,
           iters: int, hc_eps: float, norm_eps: float, cfg: ModelConfig | None = None):
    """Collapses the streams for a sub-layer.

    x `[B, S, hc, D]`; fn `[(2+hc)*hc, hc*D]`, base `[(2+hc)*hc]`, scale `[3]`; cfg, the model's
    (see `_collapse`). Returns (collapsed `[B, S, D]` in x's dtype, post `[B, S, hc]` fp32,
    comb `[B, S, hc, hc]` fp32).
    """
    collapsed, m = _collapse(x, fn, base, scale, hc_eps, norm_eps, cfg)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = m[..., 2 * hc:] * scale[2] + base[2 * hc:]
    comb = sinkhorn(comb_logits.reshape(*m.shape[:-1], hc, hc), iters, hc_eps)
    return collapsed, post, comb


def hc_post(f: jnp.ndarray, x_res: jnp.ndarray, post: jnp.ndarray, comb: jnp.ndarray,
            cfg: ModelConfig | None = None) -> jnp.ndarray:
    """Expands a sub-layer output back into the streams: X'_k = post_k f + sum_j comb[j, k] X_j.

    f `[B, S, D]`, x_res `[B, S, hc, D]`; computed in fp32, returned in x_res's dtype.
    `pallas_kernels.hc_expand`, chosen as `hc_pre`'s collapse is.
    """
    if cfg is None:
        return pallas_kernels.hc_expand_ref(f, x_res, post, comb)
    device = per_device(cfg, partial(pallas_kernels.hc_expand, impl=cfg.attention_impl),
                        (_ROWS, _STREAMS, _ROWS, _STREAMS), _STREAMS)
    return xla_cpu.choose(f, x_res, post, comb, cpu=pallas_kernels.hc_expand_ref, device=device)


def hc_head(x: jnp.ndarray, fn: jnp.ndarray, base: jnp.ndarray, scale: jnp.ndarray, *, hc_eps: float,
            norm_eps: float, cfg: ModelConfig | None = None) -> jnp.ndarray:
    """Final collapse of the streams (no Sinkhorn, no post): x `[B, S, hc, D]` -> `[B, S, D]`;
    cfg as `hc_pre`'s."""
    return _collapse(x, fn, base, scale, hc_eps, norm_eps, cfg)[0]
