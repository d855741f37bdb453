"""The Pallas kernels lower for TPU and CUDA at DeepSeek-V4-Flash shapes (the sparse attention
also at DeepSeek-V4-Pro shapes), checked on CPU with jax.export (no accelerator needed): the
export must succeed and the module must carry the backend's custom call (tpu_custom_call for
Mosaic TPU, mosaic_gpu for Mosaic GPU).

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

D, WINDOW = 512, 128
# (heads, top-k, compressed cache entries at decode) of DeepSeek-V4-Flash and DeepSeek-V4-Pro
MODELS = {"flash": (64, 512, 4096 // 4), "pro": (128, 1024, 8192 // 4)}
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
@pytest.mark.parametrize("model", ["flash", "pro"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_sparse_attention_exports(platform, model, phase):
    # K = 128 window slots + top-k: 640 (Flash), 1152 (Pro). Decode: T = 1 over the window plus
    # the compressed cache; prefill: T = 16 tokens over themselves plus 16 / 4 compressed entries.
    h, topk, compressed = MODELS[model]
    k = WINDOW + topk
    t, n = (1, WINDOW + compressed) if phase == "decode" else (S_PREFILL, S_PREFILL + S_PREFILL // 4)
    args = (jax.ShapeDtypeStruct((1, t, h, D), jnp.bfloat16), jax.ShapeDtypeStruct((1, n, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, t, k), jnp.int32), jax.ShapeDtypeStruct((h,), jnp.float32))
    text = _export(lambda *x: sparse_attention(*x, scale=D ** -0.5, impl="pallas"), platform, *args)
    _expect_kernel(platform, text, sparse_attention_mgpu_status(), "sparse attention")


@pytest.mark.parametrize("h, d", [(8, 512), (96, 384)])
def test_sparse_attention_mgpu_other_shapes_export(h, d):
    # The Mosaic GPU kernel's head padding (8 -> one group of 64, 96 -> two groups) and the
    # 128-wide TMA boxes for D not a multiple of 256 lower too (not the reference fallback).
    t, n, k = 2, 300, 200
    args = (jax.ShapeDtypeStruct((1, t, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, n, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, t, k), jnp.int32), jax.ShapeDtypeStruct((h,), jnp.float32))
    text = _export(lambda *x: sparse_attention(*x, scale=d ** -0.5, impl="pallas"), "cuda", *args)
    _expect_kernel("cuda", text, sparse_attention_mgpu_status(), "sparse attention")


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
