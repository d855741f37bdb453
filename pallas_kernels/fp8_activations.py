"""`fp8_activation_matmul`: x times an FP8 weight with x itself quantized to FP8 first, the numerics
of DeepSeek's reference inference (`act_quant` with power-of-two scales per 128 columns, then
`fp8_gemm` with a block-by-block fp32 accumulation; ../shared/docs/architecture.md sections 2.4 and 2.7).
Opt-in: `quantized_matmul` multiplies x as it is by the dequantized weight. A choice of
implementation as there (see `_dispatch`)."""

from __future__ import annotations

from ._dispatch import dispatch
from .fp8_activations_gpu import fp8_activation_matmul_gpu
from .fp8_activations_ref import act_quant, fp8_activation_matmul_ref
from .fp8_activations_tpu import fp8_activation_matmul_tpu

__all__ = ["act_quant", "fp8_activation_matmul", "fp8_activation_matmul_ref"]


def fp8_activation_matmul(x, w, *, layer=None, impl: str = "auto"):
    """x `[..., K]` (bf16 or fp32) times w (a 2-d FP8 `QuantizedWeight` `[N, K]`) transposed, x
    quantized by `act_quant`: `[..., N]` in x's dtype (`fp8_activation_matmul_ref`'s contract).
    With `layer` (int scalar, may be traced), w is the stack `[L, N, K]` of every layer's weight,
    of which the kernels read layer `layer` in place. impl: "ref" (plain JAX), "pallas" (the
    Mosaic TPU kernel on TPU, the Pallas-Triton kernel on CUDA, the TPU kernel in the Pallas
    interpreter elsewhere) or "auto" (the kernels on TPU and CUDA, the reference elsewhere).
    Both kernels multiply the e4m3 operands as they are: on the FP8 tensor cores of Hopper, on
    the MXU of TPU v7x (Mosaic widens them on chip for the MXUs of v5e, v5p and v6e, which take
    no FP8)."""
    lead_axes = 1 if layer is not None else 0
    if getattr(w, "fmt", None) != "fp8" or w.ndim != 2 + lead_axes or w.shape[-1] != x.shape[-1]:
        stack = "[L, N, K]" if layer is not None else "[N, K]"
        kind = f"an {w.fmt} weight" if hasattr(w, "fmt") else f"a {type(w).__name__}"
        raise ValueError(f"fp8_activation_matmul: x {tuple(x.shape)} and {kind} {list(w.shape)} "
                         f"(needs an fp8 QuantizedWeight {stack} with K = {x.shape[-1]})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])

    def kernel(matmul, **kw):
        def run(x):
            q, s = act_quant(x)
            return matmul(q, s, w.values, w.scale, out_dtype=x.dtype, layer=layer, **kw)
        return run

    def ref(x):
        return fp8_activation_matmul_ref(x, w if layer is None else w[layer])

    run = dispatch(impl, ref=ref, tpu=kernel(fp8_activation_matmul_tpu), gpu=kernel(fp8_activation_matmul_gpu),
                   interpret=kernel(fp8_activation_matmul_tpu, interpret=True))
    return run(x2).reshape(lead + (w.shape[-2],))
