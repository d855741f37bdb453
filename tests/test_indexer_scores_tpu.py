"""The lightning indexer's score kernel over FP8 key records for TPU
(pallas_kernels/indexer_scores_tpu.py, Mosaic TPU): its numerics in the Pallas interpreter on CPU
against `indexer_scores_ref` of the records' decoded keys, its compile for TPU v5p, v6e and v7x at
Flash's shapes (the TPU compiler, no TPU needed), and its declared cost.

Tolerances: the kernel and the reference sum the same fp32 products (exact for bf16 queries times
decoded record values, e4m3 codes times powers of two; fp32 at HIGHEST precision) scaled by
the same weights, in another order (the MXU's, XLA's): max |kernel - ref| <= 1e-5 * max |ref|, a
few fp32 ulps of the sums. The interpreter does not model the MXU's passes; the compile tests
prove the kernel lowers for each chip, not its speed (nothing here has run on a TPU).
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
from pallas_kernels import indexer_scores_tpu as ist, kv_record  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32


def _operands(b, t, h, n, d, dtype, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    # keys of mixed magnitudes, so that the records' blocks take different scales
    keys = jnp.asarray(rng.standard_normal((b, n, d)) * np.exp(rng.uniform(-6, 6, (b, n, 1))), dtype)
    w = jnp.asarray(rng.standard_normal((b, t, h)) * h ** -0.5, F32)  # signed, as weights_proj gives
    return q, keys, w


def _close(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    assert np.max(np.abs(out - ref)) <= 1e-5 * np.max(np.abs(ref)), np.max(np.abs(out - ref))


# Decode (T = 1) to prefill (several token blocks, a partial last one); N from fewer than a
# sublane tile of keys to several key blocks with a partial last one; one and two rows; both
# dtypes; both grid orders (keys outer where the queries are small, queries outer where the keys
# are few and the queries many).
SHAPES = [(1, 1, 4, 200, 128, BF16), (2, 3, 8, 70, 64, F32), (1, 20, 4, 33, 32, F32), (2, 40, 3, 2100, 128, BF16),
          (1, 17, 2, 1, 16, F32), (1, 1, 64, 2500, 128, BF16), (1, 300, 8, 1100, 16, F32)]


@pytest.mark.parametrize("b, t, h, n, d, dtype", SHAPES)
def test_indexer_scores_tpu_matches_ref(b, t, h, n, d, dtype):
    """The kernel against the reference of the records' decoded values (`kv_record.read`, as the
    cache's readers see them); through `indexer_scores` with impl "pallas" too (the TPU kernel,
    interpreted, off TPU)."""
    q, keys, w = _operands(b, t, h, n, d, dtype, seed=b * 1000 + t * 10 + n)
    records = kv_record.to_words(kv_record.encode(keys, 0))
    ref = pallas_kernels.indexer_scores_ref(q, kv_record.read(records, d, 0, dtype), w)
    _close(ist.indexer_scores_tpu(q, records, w, interpret=True), ref)
    _close(pallas_kernels.indexer_scores(q, records, w, impl="pallas"), ref)


def test_indexer_scores_tpu_grid_orders():
    """SHAPES cover both grid orders, and each order is the one that reads fewer bytes."""
    orders = set()
    for b, t, h, n, d, dtype in SHAPES:
        q_bytes, key_bytes = h * d * jnp.dtype(dtype).itemsize, kv_record.record_bytes(d, 0)
        keys_outer, nbytes = ist._reads(b, t, n, q_bytes, key_bytes)
        tt, tn = ist.tiles(t, n)
        n_t, n_n = -(-t // tt), -(-n // tn)
        q_all, k_all = b * t * q_bytes, b * n * key_bytes
        other = q_all + (n_t if n_n > 1 else 1) * k_all if keys_outer else k_all + (n_n if n_t > 1 else 1) * q_all
        assert q_all + k_all <= nbytes <= other
        orders.add(keys_outer)
    assert orders == {True, False}


def test_indexer_scores_tpu_empty_and_errors():
    q, keys, w = _operands(1, 3, 2, 5, 64, F32, seed=1)
    records = kv_record.to_words(kv_record.encode(keys, 0))
    assert ist.indexer_scores_tpu(q, records[:, :0], w, interpret=True).shape == (1, 3, 0)
    with pytest.raises(ValueError, match=r"key records of D=64 are uint32 \[B, N, 18\]"):
        ist.indexer_scores_tpu(q, records[..., 1:], w, interpret=True)
    with pytest.raises(ValueError, match="got float32"):
        ist.indexer_scores_tpu(q, keys, w, interpret=True)
    with pytest.raises(ValueError, match="disagree"):
        ist.indexer_scores_tpu(q, records, w[:, :2], interpret=True)


# Flash's indexer: 64 heads of 128; a decode step against 2,048 keys (an 8K context) and a 1M
# context's 262,144, and a 512-token prefill chunk against 2,176 (a partial last key block).
COMPILE = {"decode": (1, 1, 64, 2048, 128), "decode-1m": (1, 1, 64, 262144, 128), "prefill": (1, 512, 64, 2176, 128)}


@pytest.mark.parametrize("case", sorted(COMPILE))
@pytest.mark.parametrize("target", ["v5p-8", "v6e-8", "tpu7x-8"])
def test_indexer_scores_tpu_compiles(target, case):
    """Through `indexer_scores` (impl "pallas" and "auto"), the program over records compiled for
    one chip of the target is the one Mosaic kernel, named, and no XLA op holds the keys as
    values (`[N, 128]` of any float type: decoded) or the products of every key with every query
    head; the reference's program does decode them (the check bites). Keys as bf16 values take
    XLA's fused product (no kernel)."""
    b, t, h, n, d = COMPILE[case]
    records = S((b, n, kv_record.record_bytes(d, 0) // 4), jnp.uint32)
    q, w = S((b, t, h, d), BF16), S((b, t, h), F32)
    for impl in ("pallas", "auto"):
        compiled = aot.compile_for(target, jax.jit(lambda q, k, w: pallas_kernels.indexer_scores(q, k, w, impl=impl)),
                                   q, records, w).compiled
        assert aot.kernel_calls(compiled, "tpu") == [ist.KERNEL_NAME]
        text = compiled.as_text()
        assert _arrays(text, r"f32", b * n * t * h) == []
        assert _arrays(text, r"(?:bf16|f32|f8e4m3fn)", b * n * d) == []
    plain = aot.compile_for(target, jax.jit(lambda q, k, w: pallas_kernels.indexer_scores(q, k, w, impl="ref")),
                            q, records, w).compiled
    assert aot.kernel_calls(plain, "tpu") == [] and _arrays(plain.as_text(), r"(?:bf16|f32|f8e4m3fn)", b * n * d)
    values = aot.compile_for(target, jax.jit(lambda q, k, w: pallas_kernels.indexer_scores(q, k, w, impl="auto")),
                             q, S((b, n, d), BF16), w).compiled
    assert aot.kernel_calls(values, "tpu") == []


def _arrays(text: str, dtypes: str, size: int) -> list[str]:
    """The arrays of `dtypes` (a regex) in a compiled program with `size` elements."""
    return [dims for dims in re.findall(dtypes + r"\[([0-9,]+)\]", text)
            if math.prod(map(int, dims.split(","))) == size]


@pytest.mark.parametrize("b, t, h, n, d, dtype", [
    (1, 1, 64, 262144, 128, BF16), (1, 512, 64, 2176, 128, BF16), (8, 512, 64, 65536, 128, BF16),
    (2, 5, 4, 300, 64, F32)])
def test_indexer_scores_tpu_declared_cost(b, t, h, n, d, dtype):
    """The pallas_call's CostEstimate (dsv4-plan counts the kernel by it): bytes (HBM) at least the
    records as stored (136 bytes a key of 128 values, against bf16's 256), the queries, the
    weights and the scores once, and exactly that plus the re-reads of its grid order; flops at
    least the products' 2 B T H N D."""
    record = kv_record.record_bytes(d, 0)
    args = (S((b, t, h, d), dtype), S((b, n, record // 4), jnp.uint32), S((b, t, h), F32))
    jaxpr = jax.make_jaxpr(ist.indexer_scores_tpu)(*args)
    [cost] = [e.params["cost_estimate"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    q_bytes = b * t * h * d * jnp.dtype(dtype).itemsize
    once = b * n * record + q_bytes + b * t * h * 4 + b * t * n * 4
    assert cost.flops >= 2 * b * t * h * n * d
    assert cost.bytes_accessed >= once
    tt, tn = ist.tiles(t, n)
    n_t, n_n = -(-t // tt), -(-n // tn)
    keys_outer = once + (n_n - 1 if n_t > 1 else 0) * q_bytes
    q_outer = once + (n_t - 1 if n_n > 1 else 0) * b * n * record
    assert cost.bytes_accessed == min(keys_outer, q_outer)
