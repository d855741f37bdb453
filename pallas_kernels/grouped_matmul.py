"""`grouped_matmul`: rows sorted by expert times their experts' weights (the routed experts'
matmul), the weights kept as stored (plain, FP8 or FP4), with a choice of implementation (see
`_dispatch`)."""

from __future__ import annotations

from ._dispatch import dispatch
from .grouped_matmul_gpu import grouped_matmul_gpu
from .grouped_matmul_ref import grouped_matmul_ref
from .grouped_matmul_tpu import grouped_matmul_tpu


def grouped_matmul(x, w, group_sizes, *, layer=None, impl: str = "auto"):
    """x `[M, K]` (bf16 or fp32) times each group's expert of w transposed: `[M, N]` in x's
    dtype, products accumulated in fp32, rows past sum(group_sizes) zero.

    x's rows are sorted by expert: group g (group_sizes[g] rows, int32 `[E]`, sum <= M, not
    checked) follows group g - 1. w: `[E, N, K]`, a plain array (bf16, fp32) or a
    `QuantizedWeight` (FP8 or FP4, as stored; dequantized as `QuantizedWeight.dequantize`
    does, to x's dtype); with `layer` (int scalar, may be traced) the stack `[L, E, N, K]` of
    every layer, of which layer `layer` is used without slicing it out first.
    impl: "ref" (`grouped_matmul_ref`: dequantize, then a ragged product), "pallas" (the Mosaic
    TPU kernel on TPU, the Pallas-Triton kernel `grouped_matmul_gpu` on CUDA, and the TPU
    kernel in the Pallas interpreter elsewhere) or "auto" (the kernels on TPU and CUDA, the
    reference elsewhere)."""
    lead = 2 if layer is not None else 1
    if (x.ndim != 2 or len(w.shape) != lead + 2 or w.shape[-1] != x.shape[1]
            or group_sizes.shape != (w.shape[lead - 1],)):
        stack = "[L, E, N, K]" if layer is not None else "[E, N, K]"
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)}, a weight {list(w.shape)} and group_sizes "
                         f"{tuple(group_sizes.shape)} (needs x [M, K], w {stack}, group_sizes [E])")
    if hasattr(w, "fmt"):
        values, scale, fmt = w.values, w.scale, w.fmt
    else:
        values, scale, fmt = w, None, None

    def kernel(interpret):
        return lambda x, g, *l: grouped_matmul_tpu(x, values, g, fmt=fmt, scale=scale, layer=l[0] if l else None,
                                                   interpret=interpret)

    def gpu(x, g, *l):
        return grouped_matmul_gpu(x, values, g, fmt=fmt, scale=scale, layer=l[0] if l else None)

    def ref(x, g, *l):
        return grouped_matmul_ref(x, w, g, layer=l[0] if l else None)

    run = dispatch(impl, ref=ref, tpu=kernel(False), gpu=gpu, interpret=kernel(True))
    return run(x, group_sizes, *(() if layer is None else (layer,)))
