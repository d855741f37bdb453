"""`sparse_attention`: the sparse-gather attention with a per-head sink, with a choice of
implementation (see `_dispatch`)."""

from __future__ import annotations

import functools

from ._dispatch import dispatch
from .numerics import rotate_heads, unweighted_rms_norm
from .query_gpu import query_norm_rope_gpu
from .sparse_attention_fp8_gpu import sparse_attention_fp8_gpu
from .sparse_attention_mgpu import sparse_attention_mgpu
from .sparse_attention_ref import sparse_attention_ref
from .sparse_attention_tpu import sparse_attention_tpu


def sparse_attention(q, kv, indices, sink, query_rope=None, *, scale: float, impl: str = "auto",
                     rope_dim: int | None = None, q_norm_eps: float | None = None):
    """q `[B, T, H, D]`, kv `[B, N, D]`, indices int32 `[B, T, K]` into kv's N axis (-1: no key),
    sink fp32 `[H]` -> `[B, T, H, D]` in q's dtype; the semantics of `sparse_attention_ref`.
    With rope_dim, kv holds DeepSeek's FP8 records (`kv_record`) as uint32 words `[B, N, R / 4]`,
    and the kernels decode the rows they gather. With query_rope = (cos, sin) `[B, T, rope/2]`,
    q comes unrotated and the output stays at the queries' rotation (as the reference leaves
    it): the TPU kernel rotates q in VMEM (on TPU, rotating a head's last dims in XLA re-lays the
    whole `[T, H, D]` queries out with T minor); the GPU kernels get it rotated. With
    q_norm_eps, q comes before its per-head RMS norm (`unweighted_rms_norm`) too: the TPU kernel
    scales it in VMEM (in XLA, on TPU, the norm re-lays the queries out as the rotation does);
    the GPU kernels get it normalized (with the rotation, in one pass: `query_norm_rope_gpu`).

    impl: "ref" (plain JAX), "pallas" (Mosaic TPU on TPU; on CUDA Mosaic GPU, or for records the
    Pallas-Triton kernel `sparse_attention_fp8_gpu` (Mosaic GPU's TMA cannot copy a 584-byte
    row); the TPU kernel in the Pallas interpreter elsewhere) or "auto" (the kernels on TPU / CUDA,
    the reference elsewhere).
    """
    kw = dict(scale=scale, rope_dim=rope_dim)
    gpu_kernel = functools.partial(sparse_attention_mgpu, scale=scale) if rope_dim is None else \
        functools.partial(sparse_attention_fp8_gpu, **kw)

    def gpu(q, kv, indices, sink, query_rope):
        if q_norm_eps is not None and query_rope is not None:  # the queries as the kernels take them, one pass
            q = query_norm_rope_gpu(q, query_rope, eps=q_norm_eps)
        elif q_norm_eps is not None:
            q = unweighted_rms_norm(q, q_norm_eps)
        elif query_rope is not None:
            q = rotate_heads(q, query_rope)
        return gpu_kernel(q, kv, indices, sink)

    as_it_comes = dict(kw, q_norm_eps=q_norm_eps)  # the reference and the TPU kernel take q un-normalized
    run = dispatch(
        impl,
        ref=functools.partial(sparse_attention_ref, **as_it_comes),
        tpu=functools.partial(sparse_attention_tpu, **as_it_comes),
        gpu=gpu,
        interpret=functools.partial(sparse_attention_tpu, **as_it_comes, interpret=True),
    )
    return run(q, kv, indices, sink, query_rope)
