"""The Pallas kernels lower for TPU and CUDA at DeepSeek-V4-Flash shapes, checked on CPU with
jax.export (no accelerator needed): the export must succeed and the module must carry the
backend's custom call (tpu_custom_call for Mosaic TPU, mosaic_gpu for Mosaic GPU).

Note what this does and does not prove. For TPU, export runs the Pallas -> Mosaic lowering
(block-shape rules, the kernel traced into the tpu dialect); Mosaic's own layout passes and the
compile to TPU code run later inside the TPU compiler, so a kernel can still fail there. For
CUDA, the Mosaic GPU lowering runs much further at export time (down to the LLVM / NVVM dialects).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (
    compress,
    compress_mgpu_status,
    sparse_attention,
    sparse_attention_mgpu_status,
)

H, D, WINDOW, TOPK = 64, 512, 128, 512
K = WINDOW + TOPK
N_DECODE = WINDOW + 4096 // 4  # the decode cache: 128 window slots + compressed entries
S_PREFILL = 16
MARKERS = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu"}


def _export(fn, platform, *args):
    exported = jax.export.export(jax.jit(fn), platforms=[platform])(*args)
    return exported.mlir_module()


def _expect_kernel(platform, text, have_gpu_kernel, what):
    if platform == "cuda":
        # The Mosaic GPU kernels exist (pallas_kernels/README.md, GPU status); a False status
        # would mean impl="pallas" silently lowers to the plain-JAX reference on CUDA.
        assert have_gpu_kernel, f"no Mosaic GPU kernel for {what}"
    assert MARKERS[platform] in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("t, n", [(1, N_DECODE), (S_PREFILL, S_PREFILL + S_PREFILL // 4)], ids=["decode", "prefill"])
def test_sparse_attention_exports(platform, t, n):
    args = (jax.ShapeDtypeStruct((1, t, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((1, n, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, t, K), jnp.int32), jax.ShapeDtypeStruct((H,), jnp.float32))
    text = _export(lambda *x: sparse_attention(*x, scale=D ** -0.5, impl="pallas"), platform, *args)
    _expect_kernel(platform, text, sparse_attention_mgpu_status(), "sparse attention")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("ratio, d, n, prev", [(4, 512, 1, True), (4, 512, 64, False), (4, 128, 64, True),
                                                (128, 512, 1, False), (128, 512, 32, False), (128, 128, 8, False)])
def test_compress_exports(platform, ratio, d, n, prev):
    c = 2 * d if ratio == 4 else d
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct((1, n * ratio, c), f32), jax.ShapeDtypeStruct((1, n * ratio, c), f32),
            jax.ShapeDtypeStruct((d,), jnp.bfloat16), jax.ShapeDtypeStruct((1, n, 32), f32),
            jax.ShapeDtypeStruct((1, n, 32), f32)]
    if prev:
        args += [jax.ShapeDtypeStruct((1, ratio, c), f32)] * 2

    def fn(a, z, w, cos, sin, pa=None, pz=None):
        return compress(a, z, w, cos, sin, ratio=ratio, eps=1e-6, prev_a=pa, prev_z=pz, out_dtype=jnp.bfloat16,
                        impl="pallas")

    text = _export(fn, platform, *args)
    _expect_kernel(platform, text, compress_mgpu_status(), "the compressor")
