"""The GPU FP8 matmul kernel (pallas_kernels/quantized_matmul_gpu.py, Pallas-Triton): its numerics
in the Pallas interpreter on CPU against dequantize-then-multiply, its compile for an H100
(XLA's CUDA compiler, Triton and ptxas, sm_90a, no GPU needed), and its declared cost.

Tolerances (`_check`): the kernel and the reference multiply the same dequantized weight (value
times scale in fp32, rounded once to x's dtype) by the same x, with fp32 products and sums; only
the order of the sums differs (K steps of 128 or 32 here, one dot in the reference). So:
* fp32 output: max |kernel - ref| <= 1e-5 * max |ref|, a few fp32 ulps of the sums' order;
* bf16 output: max |kernel - ref| <= 2^-6 * max |ref| and fewer than 1% of the elements differ:
  the fp32 sums agree to ~1e-6 relative, but a last-bit difference can flip the one rounding
  to bf16 (1 ulp, 2^-7 relative at worst); the fraction guards against systematic errors.
The identity test needs no tolerance: every output is one product with 1.0, bit for bit.

The interpreter does not model Triton's layouts, pipelining or the tensor cores; the compile
tests prove the kernel lowers for sm_90a, not its speed (nothing here has run on a GPU).
"""

from __future__ import annotations

import re

from dsv4_jax.tools import aot  # first: it lets JAX's CUDA plugin register without a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_kernels import _check, _fp8_weight  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels import quantized_matmul_gpu as qmg  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32


def _stored_bytes(n, k):
    return n * k + 4 * -(-n // 128) * -(-k // 128)


# M from decode (one row tile, TN shrunk to 16 for parallelism) to a 512-token prefill chunk
# (several row and column tiles), K and N off the 128 blocks (masked tails), both x dtypes.
@pytest.mark.parametrize("m, n, k, dtype", [
    (1, 200, 300, F32), (3, 136, 260, BF16), (8, 384, 640, BF16), (64, 260, 130, F32), (512, 200, 300, BF16),
    (512, 136, 160, F32)])
def test_fp8_matmul_gpu_matches_ref(m, n, k, dtype):
    w = _fp8_weight(n, k, dtype, seed=m + n, float_scales=(m == 3))
    x = jnp.asarray(np.random.default_rng(k + m).standard_normal((m, k)), dtype)
    out = qmg.fp8_matmul_gpu(x, w.values, w.scale, interpret=True)
    assert out.shape == (m, n) and out.dtype == dtype
    _check(out, pallas_kernels.quantized_matmul_ref(x, w))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_matmul_gpu_dequantizes_exactly(dtype):
    """x = the identity: the output is the dequantized weight bit for bit, float scales included;
    small tiles (TN 16 < the 128 block: several tiles share one scale) and masked N and K tails."""
    n, k = 300, 260
    w = _fp8_weight(n, k, dtype, seed=7, float_scales=True)
    out = qmg.fp8_matmul_gpu(jnp.eye(k, dtype=dtype), w.values, w.scale, interpret=True, block_shape=(64, 16, 64))
    np.testing.assert_array_equal(np.asarray(out.astype(F32)), np.asarray(w.dequantize(dtype).T.astype(F32)))


def test_fp8_matmul_gpu_tiles_and_errors():
    # Decode reads the weight once (one row tile); Flash's N = 4096 gives 256 programs of 16 rows.
    assert qmg.tiles(8, 4096, BF16) == (16, 16, 128)
    assert qmg.tiles(64, 32768, BF16) == (64, 64, 128)
    assert qmg.tiles(512, 3072, BF16) == (128, 64, 128)
    assert qmg.tiles(512, 4096, F32) == (32, 64, 32)
    with pytest.raises(ValueError, match="powers of two"):
        qmg.fp8_matmul_gpu(jnp.zeros((4, 256), BF16), jnp.zeros((256, 256), jnp.float8_e4m3fn),
                           jnp.ones((2, 2), F32), block_shape=(16, 256, 128))


# (M, N, K, dtype): Flash decode at batch 8 (an N = 4096 projection of K = 4096, and N = 1536),
# a 512-token prefill chunk, and a small fp32 shape off the blocks.
COMPILE = {
    "flash-decode8": (8, 4096, 4096, BF16),
    "flash-decode64-n1536": (64, 1536, 4096, BF16),
    "flash-prefill512": (512, 1024, 4096, BF16),
    "odd-fp32": (3, 200, 300, F32),
    "pro-decode-wq_b": (1, 65536, 1536, BF16),
    "pro-prefill-shared_w1": (512, 3072, 7168, BF16),
}


@pytest.mark.parametrize("target, case", [("h100x1", c) for c in COMPILE]
                         + [("h200x8", "flash-decode8"), ("h200x8", "pro-prefill-shared_w1")])
def test_fp8_matmul_gpu_compiles_for_hopper(target, case):
    """Through `quantized_matmul` (impl "pallas" and "auto"), the program compiled for an H100 (or
    one H200 of eight) is the one Triton kernel, named, and no other op touches the weight (a copy
    or re-layout of it would be an instruction of its shape)."""
    from dsv4_jax.model.quantized import QuantizedWeight

    m, n, k, dtype = COMPILE[case]
    blocks = (-(-n // 128), -(-k // 128))
    args = (S((m, k), dtype), S((n, k), jnp.float8_e4m3fn), S(blocks, F32))
    for impl in ("pallas", "auto"):
        def fn(x, v, s):
            return pallas_kernels.quantized_matmul(x, QuantizedWeight(v, s, fmt="fp8"), impl=impl)

        compiled = aot.compile_for(target, jax.jit(fn), *args).compiled
        assert aot.kernel_calls(compiled, "cuda") == [qmg.KERNEL_NAME]
        [call] = [line for line in compiled.as_text().splitlines() if f'custom_call_target="{aot.TRITON_CALL}"' in line]
        assert f'name = "{qmg.KERNEL_NAME}"' in call
        weight_ops = [line for line in compiled.as_text().splitlines()
                      if re.search(rf"= f8e4m3fn\[{n},{k}\]", line) and " parameter(" not in line]
        assert weight_ops == []


def test_fp8_matmul_gpu_reads_a_layer_of_a_stack():
    """With `layer` (traced), the kernel reads that layer of the stack `[L, N, K]`: its numerics in
    the interpreter, and compiled for an H100, no instruction but the kernel's call holds the
    stack or a layer of it (a slice of it, as the kernel's operand, would be a copy)."""
    from dsv4_jax.model.quantized import QuantizedWeight

    parts = [_fp8_weight(136, 260, BF16, seed=s) for s in (21, 22)]
    values, scale = jnp.stack([p.values for p in parts]), jnp.stack([p.scale for p in parts])
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 260)), BF16)
    run = jax.jit(lambda x, v, s, i: qmg.fp8_matmul_gpu(x, v, s, layer=i, interpret=True))
    for i in (1, 0):
        _check(run(x, values, scale, jnp.int32(i)), pallas_kernels.quantized_matmul_ref(x, parts[i]))

    n, k = 1024, 4096
    args = (S((8, k), BF16), S((3, n, k), jnp.float8_e4m3fn), S((3, n // 128, k // 128), F32), S((), jnp.int32))

    def fn(x, v, s, i):
        return pallas_kernels.quantized_matmul(x, QuantizedWeight(v, s, fmt="fp8"), layer=i)

    compiled = aot.compile_for("h100x1", jax.jit(fn), *args).compiled
    assert aot.kernel_calls(compiled, "cuda") == [qmg.KERNEL_NAME]
    assert f'custom_call_target="{aot.TRITON_CALL}"' in compiled.as_text()
    weight_ops = [line for line in compiled.as_text().splitlines()
                  if re.search(rf"= f8e4m3fn\[(3,|1,)?{n},{k}\]", line) and " parameter(" not in line]
    assert weight_ops == []


@pytest.mark.parametrize("m, n, k, dtype", [(1, 32768, 1024, BF16), (8, 4096, 4096, BF16), (512, 3072, 7168, BF16),
                                            (4096, 1024, 7168, BF16),
                                            (3, 200, 300, F32)])
def test_fp8_matmul_gpu_declared_cost(m, n, k, dtype):
    """The pallas_call's CostEstimate: 2 M N K flops, and bytes (HBM) at least the stored weight
    (values and scales), x and the output: the weight once (its row tiles' re-reads come from
    L2), x once while it fits a quarter of L2, else once per column tile (4096 x 7168 bf16)."""
    blocks = (-(-n // 128), -(-k // 128))
    args = (S((m, k), dtype), S((n, k), jnp.float8_e4m3fn), S(blocks, F32))
    jaxpr = jax.make_jaxpr(qmg.fp8_matmul_gpu)(*args)
    [cost] = [e.params["cost_estimate"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    itemsize = jnp.dtype(dtype).itemsize
    minimum = _stored_bytes(n, k) + (m * k + m * n) * itemsize
    assert cost.flops == 2 * m * n * k
    assert cost.bytes_accessed >= minimum
    tm, tn, _ = qmg.tiles(m, n, dtype)
    x_reads = 1 if 4 * m * k * itemsize <= qmg.L2_BYTES else -(-n // tn)
    assert cost.bytes_accessed == _stored_bytes(n, k) + x_reads * m * k * itemsize + m * n * itemsize
    assert m > qmg.DECODE_M or tm >= m  # decode: one row tile
