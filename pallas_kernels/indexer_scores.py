"""`indexer_scores`: the lightning indexer's scores of every key for every query, with a choice of
implementation (see `_dispatch`)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from . import kv_record
from ._dispatch import dispatch
from .indexer_scores_gpu import indexer_scores_gpu
from .indexer_scores_ref import indexer_scores_ref


def indexer_scores(q, keys, weights, *, impl: str = "auto"):
    """q `[B, T, H, D]`, keys `[B, N, D]` or their FP8 records (uint32 words `[B, N, W]`, as a
    cache with `--kv-cache-dtype fp8` stores them: `kv_record` with no RoPE dims), weights `[B,
    T, H]` (already / sqrt(H)) -> scores fp32 `[B, T, N]`; the semantics of `indexer_scores_ref`
    (of the decoded keys, for records).

    impl: "ref" (plain JAX, records decoded first), "pallas" (the Pallas-Triton kernel on CUDA,
    which decodes records as it loads them, run by the Pallas interpreter elsewhere; on TPU the
    reference, whose product XLA fuses with its epilogue) or "auto" (the kernel on CUDA, the
    reference elsewhere)."""
    def ref(q, keys, weights):
        return indexer_scores_ref(q, kv_record.read(keys, q.shape[-1], 0, q.dtype), weights)

    gpu = ref if keys.dtype == jnp.uint32 and q.shape[-1] % 4 else indexer_scores_gpu
    return dispatch(
        impl,
        ref=ref,
        tpu=ref,
        gpu=gpu,
        interpret=functools.partial(indexer_scores_gpu, interpret=True) if gpu is indexer_scores_gpu else ref,
    )(q, keys, weights)
