"""`compress`: the KV compressor (gated pooling, RMSNorm, RoPE) with a choice of implementation
(see `_dispatch`)."""

from __future__ import annotations

import jax.numpy as jnp

from ._dispatch import dispatch
from .compressor_mgpu import compress_mgpu
from .compressor_ref import compress_ref
from .compressor_tpu import compress_tpu, supported


def compress(a, z, norm_weight, cos, sin, *, ratio: int, eps: float, prev_a=None, prev_z=None,
             out_dtype=jnp.float32, impl: str = "auto"):
    """The semantics and arguments of `compress_ref`, plus impl: "ref" (plain JAX), "pallas"
    (Mosaic TPU on TPU, Mosaic GPU on CUDA, the TPU kernel in the Pallas interpreter elsewhere)
    or "auto" (the kernels on TPU / CUDA, the reference elsewhere). Shapes the kernels do not
    cover (d not a multiple of 128, more than 128 rope dims) use the reference."""
    c = a.shape[-1]
    d = c // 2 if ratio == 4 else c
    kw = dict(ratio=ratio, eps=eps, out_dtype=out_dtype)
    if prev_a is not None and ratio != 4:
        prev_a = prev_z = None  # only the overlapping compressor reads the previous block
    ref = lambda *x: compress_ref(*x[:5], prev_a=x[5] if len(x) > 5 else None,
                                  prev_z=x[6] if len(x) > 5 else None, **kw)
    if not supported(d, 2 * cos.shape[-1]):
        impl = "ref"

    def wrap(fn, **extra):
        return lambda *x: fn(*x[:5], prev_a=x[5] if len(x) > 5 else None,
                             prev_z=x[6] if len(x) > 5 else None, **kw, **extra)

    run = dispatch(impl, ref=ref, tpu=wrap(compress_tpu), gpu=wrap(compress_mgpu),
                   interpret=wrap(compress_tpu, interpret=True))
    operands = (a, z, norm_weight, cos, sin) + (() if prev_a is None else (prev_a, prev_z))
    return run(*operands)
