"""`sparse_attention`: the sparse-gather attention with a per-head sink, with a choice of
implementation (see `_dispatch`)."""

from __future__ import annotations

import functools

from ._dispatch import dispatch
from .sparse_attention_mgpu import sparse_attention_mgpu
from .sparse_attention_ref import sparse_attention_ref
from .sparse_attention_tpu import sparse_attention_tpu


def sparse_attention(q, kv, indices, sink, *, scale: float, impl: str = "auto"):
    """q `[B, T, H, D]`, kv `[B, N, D]`, indices int32 `[B, T, K]` into kv's N axis (-1: no key),
    sink fp32 `[H]` -> `[B, T, H, D]` in q's dtype; the semantics of `sparse_attention_ref`.

    impl: "ref" (plain JAX), "pallas" (Mosaic TPU on TPU, Mosaic GPU on CUDA, the TPU kernel in
    the Pallas interpreter elsewhere) or "auto" (the kernels on TPU / CUDA, the reference elsewhere).
    """
    run = dispatch(
        impl,
        ref=functools.partial(sparse_attention_ref, scale=scale),
        tpu=functools.partial(sparse_attention_tpu, scale=scale),
        gpu=functools.partial(sparse_attention_mgpu, scale=scale),
        interpret=functools.partial(sparse_attention_tpu, scale=scale, interpret=True),
    )
    return run(q, kv, indices, sink)
