"""The Mosaic GPU kernels, run on CPU by jax's GPU interpret mode (`InterpretGPUParams`), against
the references.

The interpreter simulates GMEM / SMEM, TMA copies and barriers (SMEM starts as NaN, so reading a
slot that no copy filled shows up), and can look for races between threads and TMA copies. It
does not model register layouts: `plgpu.load` and `layout_cast` are not supported by it, so the
kernels drop those annotations when interpreted (`interpret` argument) and read refs plainly.
The compile for sm_90a (layouts, the PTX compile by ptxas) is checked by tests/test_aot_kernels.py;
bank conflicts and speed are not, and nothing here has run on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from pallas_kernels.compressor_mgpu import compress_mgpu
from pallas_kernels.compressor_ref import compress_ref
from pallas_kernels.sparse_attention_mgpu import sparse_attention_mgpu
from pallas_kernels.sparse_attention_ref import sparse_attention_ref

RTOL = 1e-5


def _close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())
    else:  # a rounding of the fp32 result: one ulp of the output dtype
        ulp = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(out, ref, rtol=ulp, atol=ulp * np.abs(ref).max())


@pytest.fixture
def interpret():
    yield InterpretGPUParams(detect_races=True)
    races = gpu_interpret.get_races().races_found
    gpu_interpret.reset_gpu_interpret_mode_state()
    assert not races, "the GPU interpreter found a data race"


# Each head geometry once, the dtypes alternating (the interpreter runs minutes per case).
@pytest.mark.parametrize("h, d, dtype", [(64, 256, jnp.bfloat16), (128, 256, jnp.float32), (8, 384, jnp.bfloat16)],
                         ids=["h64-bfloat16", "h128-float32", "h8-pad-bfloat16"])
def test_sparse_attention_mgpu_interpret(interpret, h, d, dtype):
    # H = 64: one head group (one WGMMA register tile of heads). H = 128: two head groups, each
    # gathering the same rows. H = 8: one group padded to 64 heads (zero q and sink), with D = 384
    # viewed as 3 TMA boxes of 128 (3 output column blocks). K = 40 padded to 128 (4 key blocks of
    # 32). Token (0, 1) has no valid key; -1 slots and duplicate rows are mixed in elsewhere.
    b, t, n, k = 2, 2, 24, 40
    ks = jax.random.split(jax.random.PRNGKey(h + d), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(dtype)
    kv = jax.random.normal(ks[1], (b, n, d), jnp.float32).astype(dtype)
    idx = jax.random.randint(ks[2], (b, t, k), -1, n).astype(jnp.int32)
    idx = idx.at[0, 1].set(-1).at[1, 0, :8].set(3)
    sink = jax.random.normal(ks[3], (h,), jnp.float32)
    out = sparse_attention_mgpu(q, kv, idx, sink, scale=d ** -0.5, interpret=interpret, block_k=32)
    ref = sparse_attention_ref(q, kv, idx, sink, scale=d ** -0.5)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(out[0, 1], np.float32), 0.0)
    _close(out, ref, dtype)


@pytest.mark.parametrize("ratio, d, n, prev, out_dtype", [
    (4, 128, 3, True, jnp.float32), (4, 256, 2, False, jnp.float32), (4, 128, 2, True, jnp.bfloat16),
    (128, 128, 2, False, jnp.float32), (128, 256, 1, False, jnp.bfloat16)])
def test_compress_mgpu_interpret(interpret, ratio, d, n, prev, out_dtype):
    c = 2 * d if ratio == 4 else d
    ks = jax.random.split(jax.random.PRNGKey(ratio + d + n), 7)
    a = jax.random.normal(ks[0], (2, n * ratio, c))
    z = 2 * jax.random.normal(ks[1], (2, n * ratio, c))
    w = (1 + 0.1 * jax.random.normal(ks[2], (d,))).astype(jnp.bfloat16)
    cos, sin = jax.random.normal(ks[3], (2, n, 16)), jax.random.normal(ks[4], (2, n, 16))
    pa = jax.random.normal(ks[5], (2, ratio, c)) if prev else None
    pz = jax.random.normal(ks[6], (2, ratio, c)) if prev else None
    kw = {"ratio": ratio, "eps": 1e-6, "prev_a": pa, "prev_z": pz, "out_dtype": out_dtype}
    out = compress_mgpu(a, z, w, cos, sin, interpret=interpret, **kw)
    ref = compress_ref(a, z, w, cos, sin, **kw)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    _close(out, ref, out_dtype)
