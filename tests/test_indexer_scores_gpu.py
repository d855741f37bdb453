"""The lightning indexer's score kernel for GPU (pallas_kernels/indexer_scores_gpu.py, Pallas-Triton):
its numerics in the Pallas interpreter on CPU against `indexer_scores_ref`, its compile for an
H100 and for the model's programs on h200x8 (XLA's CUDA compiler, Triton and ptxas, sm_90a, no
GPU needed), and its declared cost.

Tolerances: the kernel and the reference sum the same fp32 products (exact for bf16 operands;
IEEE fp32 for fp32 ones) scaled by the same weights, in another order (the heads one after
another here, XLA's order there): max |kernel - ref| <= 1e-5 * max |ref|, a few fp32 ulps of
the sums. The interpreter does not model Triton's layouts or the tensor cores; the compile tests
prove the kernel lowers for sm_90a, not its speed (nothing here has run on a GPU).
"""

from __future__ import annotations

import math
import re

from dsv4_jax.tools import aot  # first: it lets JAX's CUDA plugin register without a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels import indexer_scores_gpu as isg, kv_record  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32


def _operands(b, t, h, n, d, dtype, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    keys = jnp.asarray(rng.standard_normal((b, n, d)), dtype)
    w = jnp.asarray(rng.standard_normal((b, t, h)) * h ** -0.5, F32)  # signed, as weights_proj gives
    return q, keys, w


# Decode (T = 1: one masked query tile) to prefill (several query and key tiles); N and D off
# the tiles (masked tails, D padded to a power of two); both dtypes; one and two rows.
@pytest.mark.parametrize("b, t, h, n, d, dtype", [
    (1, 1, 4, 200, 128, BF16), (2, 3, 8, 70, 64, F32), (1, 64, 4, 33, 24, F32), (2, 100, 3, 130, 128, BF16),
    (1, 17, 2, 1, 16, F32)])
def test_indexer_scores_gpu_matches_ref(b, t, h, n, d, dtype):
    q, keys, w = _operands(b, t, h, n, d, dtype, seed=t + n)
    out = isg.indexer_scores_gpu(q, keys, w, interpret=True)
    ref = pallas_kernels.indexer_scores_ref(q, keys, w)
    assert out.shape == (b, t, n) and out.dtype == F32
    scale = float(jnp.max(jnp.abs(ref)))
    assert scale > 0 and float(jnp.max(jnp.abs(out - ref))) <= 1e-5 * scale
    # the ReLU matters: some products are negative and drop out
    assert float(jnp.min(jnp.einsum("bnd,bthd->bnth", keys.astype(F32), q.astype(F32)))) < 0


@pytest.mark.parametrize("b, t, h, n, d, dtype", [
    (1, 1, 4, 200, 128, BF16), (2, 3, 8, 70, 64, F32), (1, 64, 4, 33, 132, BF16), (2, 100, 3, 130, 128, F32)])
def test_indexer_scores_gpu_decodes_records(b, t, h, n, d, dtype):
    """Keys as FP8 records (the cache's words with --kv-cache-dtype fp8; D = 132 has a last partial
    scale block and pads the words to a power of two): the kernel decodes them as it loads them
    and gives the scores of the decoded keys, within the tolerance above (decoded values are
    exact in bf16); through `indexer_scores` (impl "pallas", interpreted) too."""
    q, keys, w = _operands(b, t, h, n, d, dtype, seed=t + n + 1)
    words = kv_record.to_words(kv_record.encode(keys * 3.0, 0))
    assert words.dtype == jnp.uint32 and words.shape == (b, n, kv_record.record_bytes(d, 0) // 4)
    ref = pallas_kernels.indexer_scores_ref(q, kv_record.read(words, d, 0, dtype), w)
    scale = float(jnp.max(jnp.abs(ref)))
    for out in (isg.indexer_scores_gpu(q, words, w, interpret=True),
                pallas_kernels.indexer_scores(q, words, w, impl="pallas")):
        assert out.shape == (b, t, n) and float(jnp.max(jnp.abs(out - ref))) <= 1e-5 * scale
    assert pallas_kernels.indexer_scores(q, words, w, impl="ref") == pytest.approx(ref)


def test_indexer_scores_gpu_empty_and_errors():
    """No keys or no queries give an empty result; mismatched shapes and dtypes are a ValueError
    naming the operands."""
    q, keys, w = _operands(1, 3, 2, 5, 16, F32, seed=0)
    assert isg.indexer_scores_gpu(q, keys[:, :0], w, interpret=True).shape == (1, 3, 0)
    with pytest.raises(ValueError, match="need"):
        isg.indexer_scores_gpu(q, keys[..., :8], w, interpret=True)
    with pytest.raises(ValueError, match="both bfloat16 or both float32"):
        isg.indexer_scores_gpu(q, keys.astype(BF16), w, interpret=True)
    with pytest.raises(ValueError, match="records"):
        isg.indexer_scores_gpu(q, kv_record.to_words(kv_record.encode(keys, 0))[..., 1:], w, interpret=True)


# Flash's indexer: 64 heads of 128; a decode step against a 1M-token context's 262,144 keys and
# a 512-token prefill chunk against 2,176.
COMPILE = {"decode-1m": (1, 1, 64, 262144, 128), "prefill": (1, 512, 64, 2176, 128), "fp32": (2, 5, 4, 300, 64),
           "decode-1m-fp8": (1, 1, 64, 262144, 128)}


@pytest.mark.parametrize("target, case", [("h100x1", c) for c in sorted(COMPILE)] + [("h200x8", "prefill")])
def test_indexer_scores_gpu_compiles_for_hopper(target, case):
    """Through `indexer_scores` (impl "pallas" and "auto"), the program compiled for an H100 (or
    one H200 of eight) is the one Triton kernel, named, and nothing in it holds the products of
    every key with every query head (the `[N, T H]` fp32 XLA writes out without it)."""
    b, t, h, n, d = COMPILE[case]
    dtype = F32 if case == "fp32" else BF16
    keys = S((b, n, kv_record.record_bytes(d, 0) // 4), jnp.uint32) if case.endswith("fp8") else S((b, n, d), dtype)
    args = (S((b, t, h, d), dtype), keys, S((b, t, h), F32))
    for impl in ("pallas", "auto"):
        compiled = aot.compile_for(target, jax.jit(lambda q, k, w: pallas_kernels.indexer_scores(q, k, w, impl=impl)),
                                   *args).compiled
        assert aot.kernel_calls(compiled, "cuda") == [isg.KERNEL_NAME]
        assert f'custom_call_target="{aot.TRITON_CALL}"' in compiled.as_text()
        assert _products(compiled.as_text(), b * n * t * h) == []
    plain = aot.compile_for(target, jax.jit(lambda q, k, w: pallas_kernels.indexer_scores(q, k, w, impl="ref")),
                            *args).compiled
    assert aot.kernel_calls(plain, "cuda") == [] and _products(plain.as_text(), b * n * t * h)


def _products(text: str, size: int) -> list[str]:
    """The fp32 arrays of a compiled program with `size` elements (the products of every key with
    every query head: `f32[2176,32768]` for a 512-token chunk of 64 heads against 2,176 keys)."""
    return [dims for dims in re.findall(r"f32\[([0-9,]+)\]", text) if math.prod(map(int, dims.split(","))) == size]


@pytest.mark.parametrize("b, t, h, n, d, dtype, records", [
    (1, 1, 64, 262144, 128, BF16, False), (1, 512, 64, 2176, 128, BF16, False), (8, 512, 64, 65536, 128, BF16, False),
    (2, 5, 4, 300, 64, F32, False), (1, 1, 64, 262144, 128, BF16, True)])
def test_indexer_scores_gpu_declared_cost(b, t, h, n, d, dtype, records):
    """The pallas_call's CostEstimate: 2 B T H N D flops, and bytes (HBM) at least the keys (or
    their records: 136 bytes a key of 128 values against bf16's 256), the queries, the weights
    and the scores once; the queries once while they fit a quarter of L2, else once per key
    tile."""
    key_bytes = kv_record.record_bytes(d, 0) if records else d * jnp.dtype(dtype).itemsize
    keys = S((b, n, key_bytes // 4), jnp.uint32) if records else S((b, n, d), dtype)
    args = (S((b, t, h, d), dtype), keys, S((b, t, h), F32))
    jaxpr = jax.make_jaxpr(isg.indexer_scores_gpu)(*args)
    [cost] = [e.params["cost_estimate"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    itemsize = jnp.dtype(dtype).itemsize
    q_bytes = b * t * h * d * itemsize
    once = b * n * key_bytes + q_bytes + b * t * h * 4 + b * t * n * 4
    assert cost.flops == 2 * b * t * h * n * d
    assert cost.bytes_accessed >= once
    q_reads = 1 if 4 * q_bytes <= isg.L2_BYTES else -(-n // isg.tiles(t, dtype)[1])
    assert cost.bytes_accessed == once + (q_reads - 1) * q_bytes
    assert (q_reads > 1) == (b * t == 8 * 512)
