"""`indexer_scores`: the lightning indexer's scores of every key for every query, with a choice of
implementation (see `_dispatch`)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from . import kv_record
from ._dispatch import dispatch
from .indexer_scores_gpu import indexer_scores_gpu
from .indexer_scores_ref import indexer_scores_ref
from .indexer_scores_tpu import indexer_scores_tpu


def indexer_scores(q, keys, weights, *, impl: str = "auto"):
    """q `[B, T, H, D]`, keys `[B, N, D]` or their FP8 records (uint32 words `[B, N, W]`, as a
    cache with `--kv-cache-dtype fp8` stores them: `kv_record` with no RoPE dims), weights `[B,
    T, H]` (already / sqrt(H)) -> scores fp32 `[B, T, N]`; the semantics of `indexer_scores_ref`
    (of the decoded keys, for records).

    impl: "ref" (plain JAX, records decoded first), "pallas" (CUDA: the Pallas-Triton kernel, keys
    as values or records; TPU: over records the Mosaic kernel, over values the reference, whose
    product XLA fuses with its epilogue; elsewhere TPU's choice, its kernel run by the Pallas
    interpreter) or "auto" (the kernels on TPU / CUDA, the reference elsewhere). The kernels
    decode records as they load them; records whose D is not whole words of codes (D % 4) are
    decoded first on every platform."""
    def ref(q, keys, weights):
        return indexer_scores_ref(q, kv_record.read(keys, q.shape[-1], 0, q.dtype), weights)

    whole_words = q.shape[-1] % kv_record.PLANES == 0
    records = keys.dtype == jnp.uint32
    tpu = indexer_scores_tpu if records and whole_words else ref
    return dispatch(
        impl,
        ref=ref,
        tpu=tpu,
        gpu=indexer_scores_gpu if whole_words or not records else ref,
        interpret=functools.partial(tpu, interpret=True) if tpu is indexer_scores_tpu else ref,
    )(q, keys, weights)
