"""`sparse_attention`: the sparse-gather attention with a per-head sink, with a choice of
implementation (see `_dispatch`)."""

from __future__ import annotations

import functools

from ._dispatch import dispatch
from .numerics import rotate_heads
from .sparse_attention_fp8_gpu import sparse_attention_fp8_gpu
from .sparse_attention_mgpu import sparse_attention_mgpu
from .sparse_attention_ref import sparse_attention_ref
from .sparse_attention_tpu import sparse_attention_tpu


def sparse_attention(q, kv, indices, sink, query_rope=None, *, scale: float, impl: str = "auto",
                     rope_dim: int | None = None):
    """q `[B, T, H, D]`, kv `[B, N, D]`, indices int32 `[B, T, K]` into kv's N axis (-1: no key),
    sink fp32 `[H]` -> `[B, T, H, D]` in q's dtype; the semantics of `sparse_attention_ref`.
    With rope_dim, kv holds DeepSeek's FP8 records (`kv_record`) as uint32 words `[B, N, R / 4]`,
    and the kernels decode the rows they gather. With query_rope = (cos, sin) `[B, T, rope/2]`,
    q and the output are unrotated: the TPU kernel rotates them in VMEM (on TPU, rotating a
    head's last dims in XLA re-lays the whole `[T, H, D]` queries out with T minor); the GPU
    kernels get them rotated around the call.

    impl: "ref" (plain JAX), "pallas" (Mosaic TPU on TPU; on CUDA Mosaic GPU, or for records the
    Pallas-Triton kernel `sparse_attention_fp8_gpu` (Mosaic GPU's TMA cannot copy a 584-byte
    row); the TPU kernel in the Pallas interpreter elsewhere) or "auto" (the kernels on TPU / CUDA,
    the reference elsewhere).
    """
    kw = dict(scale=scale, rope_dim=rope_dim)
    gpu_kernel = functools.partial(sparse_attention_mgpu, scale=scale) if rope_dim is None else \
        functools.partial(sparse_attention_fp8_gpu, **kw)

    def gpu(q, kv, indices, sink, query_rope):
        if query_rope is None:
            return gpu_kernel(q, kv, indices, sink)
        return rotate_heads(gpu_kernel(rotate_heads(q, query_rope), kv, indices, sink), query_rope, inverse=True)

    run = dispatch(
        impl,
        ref=functools.partial(sparse_attention_ref, **kw),
        tpu=functools.partial(sparse_attention_tpu, **kw),
        gpu=gpu,
        interpret=functools.partial(sparse_attention_tpu, **kw, interpret=True),
    )
    return run(q, kv, indices, sink, query_rope)
