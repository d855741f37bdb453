"""`quantized_matmul`: x times a weight kept as the published checkpoints store it (FP8 with
128x128 block scales, FP4 with per-32 E8M0 scales), with a choice of implementation (see
`_dispatch`)."""

from __future__ import annotations

from ._dispatch import dispatch
from .quantized_matmul_ref import quantized_matmul_ref
from .quantized_matmul_tpu import fp8_matmul_tpu


def quantized_matmul(x, w, *, impl: str = "auto"):
    """x `[..., K]` (bf16 or fp32) times w (a 2-d `QuantizedWeight` `[N, K]`) transposed:
    `[..., N]` in x's dtype, products accumulated in fp32 (`quantized_matmul_ref`'s contract).
    impl: "ref" (dequantize, then multiply), "pallas" (the Mosaic TPU kernel on TPU, and in the
    Pallas interpreter on other platforms) or "auto" (the kernel on TPU, the reference
    elsewhere). FP4 weights, and FP8 on CUDA, have no kernel yet: they use the reference."""
    if w.ndim != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"quantized_matmul: x {tuple(x.shape)} and a weight {list(w.shape)} (needs [N, {x.shape[-1]}])")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w.fmt != "fp8":
        impl = "ref"
    run = dispatch(impl, ref=lambda x: quantized_matmul_ref(x, w),
                   tpu=lambda x: fp8_matmul_tpu(x, w.values, w.scale),
                   gpu=lambda x: quantized_matmul_ref(x, w),
                   interpret=lambda x: fp8_matmul_tpu(x, w.values, w.scale, interpret=True))
    return run(x2).reshape(lead + (w.shape[0],))
