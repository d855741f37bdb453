"""`quantized_matmul`: x times a weight kept as the published checkpoints store it (FP8 with
128x128 block scales, FP4 with per-32 E8M0 scales), with a choice of implementation (see
`_dispatch`)."""

from __future__ import annotations

import jax.numpy as jnp

from ._dispatch import dispatch
from .grouped_matmul import grouped_matmul
from .quantized_matmul_gpu import fp8_matmul_gpu
from .quantized_matmul_ref import quantized_matmul_ref
from .quantized_matmul_tpu import fp8_matmul_tpu


def quantized_matmul(x, w, *, layer=None, impl: str = "auto"):
    """x `[..., K]` (bf16 or fp32) times w (a 2-d `QuantizedWeight` `[N, K]`) transposed:
    `[..., N]` in x's dtype, products accumulated in fp32 (`quantized_matmul_ref`'s contract).
    With `layer` (int scalar, may be traced), w is the stack `[L, N, K]` of every layer's weight,
    of which the kernels read layer `layer` in place (sliced out first, it would be copied).
    impl: "ref" (dequantize, then multiply), "pallas" (the Mosaic TPU kernel on TPU, the
    Pallas-Triton kernel on CUDA, and the TPU kernel in the Pallas interpreter on other
    platforms) or "auto" (the kernels on TPU and CUDA, the reference elsewhere). An FP4 weight
    (per-32 E8M0 scales along K) is one expert of `grouped_matmul`, whose kernels read FP4 as
    stored: every row one group (the weight viewed as `[1, N, K]` or `[L, 1, N, K]`, a bitcast)."""
    lead_axes = 1 if layer is not None else 0
    if w.ndim != 2 + lead_axes or w.shape[-1] != x.shape[-1]:
        stack = "[L, N, K]" if layer is not None else "[N, K]"
        raise ValueError(f"quantized_matmul: x {tuple(x.shape)} and a weight {list(w.shape)} "
                         f"(needs {stack} with K = {x.shape[-1]})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w.fmt == "fp4":
        one_expert = w.replace(values=w.values[..., None, :, :], scale=w.scale[..., None, :, :])
        rows = jnp.full((1,), x2.shape[0], jnp.int32)
        return grouped_matmul(x2, one_expert, rows, layer=layer, impl=impl).reshape(lead + (w.shape[-2],))
    own = w if layer is None else w[layer]

    def run_tpu(x, interpret=False):
        return fp8_matmul_tpu(x, w.values, w.scale, layer=layer, interpret=interpret)

    run = dispatch(impl, ref=lambda x: quantized_matmul_ref(x, own), tpu=run_tpu,
                   gpu=lambda x: fp8_matmul_gpu(x, w.values, w.scale, layer=layer),
                   interpret=lambda x: run_tpu(x, interpret=True))
    return run(x2).reshape(lead + (w.shape[-2],))
