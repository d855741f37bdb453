"""Dense projections with the reference's dtype rule: the input is cast to the weight's dtype,
products accumulate in fp32, and the output comes back in the weight's dtype.

A `QuantizedWeight` (FP8 / FP4, `dsv4-convert --dtype native`) is multiplied as stored, so a
native checkpoint gives the results of a dequantized one (the same products, at most summed in
another order). Where it runs depends on the platform the program is lowered for:

* TPU and GPU: `pallas_kernels.quantized_matmul` (the FP8 kernels read each stored byte once
  and dequantize on chip; a layer's weight in place in its stack, `LayerSlice`), given the
  model's config: on a mesh it runs once per device, with the rows split as the batch and the
  weight as its logical axes say, when every device holds whole rows of the weight's input dim;
  a weight whose input dim is split (a row-parallel projection) stays on XLA's partitioned
  product, whose partial sums add up in fp32 before rounding;
* otherwise (no config, the per-device code of the routed experts; FP4): by its scale blocks
  (`QuantizedWeight.matmul`: XLA fuses the dequantization into the product instead of writing
  the weight out);
* CPU: the whole dequantized weight (bit for bit a dequantized checkpoint's products and sums).

With `ModelConfig.fp8_activations` an FP8 weight's input is quantized to e4m3 per 128 columns
first and the products are DeepSeek's reference `fp8_gemm`'s (`pallas_kernels.fp8_activation_matmul`:
the FP8 tensor-core kernel on CUDA, its plain-JAX twin elsewhere), on every platform, per
device on a mesh (a row-parallel weight's partial products summed over the devices that split
its input: the quantization blocks of 128 columns stay whole on a device).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

import pallas_kernels  # looked up at call time: pallas_kernels imports our primitives

from .config import ModelConfig
from .layer_weights import LayerSlice, LayerWeight, own_weight, with_weight
from .quantized import FP8, QuantizedWeight
from .sharding import active, per_device, rows_axis


def weight_array(w) -> jnp.ndarray:
    """w itself, or a QuantizedWeight dequantized to its compute dtype."""
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def dense(x: jnp.ndarray, w, cfg: ModelConfig | None = None) -> jnp.ndarray:
    """x `[..., in]`, w `[out, in]` (array, QuantizedWeight, LayerSlice or LayerWeight) ->
    `[..., out]` in w's dtype. cfg, the model's, lets a quantized weight take the matmul kernel
    on TPU (its `attention_impl` choice, per device on its mesh); code already running per
    device passes none."""
    if cfg is not None and cfg.fp8_activations and _fp8(w):
        fp8_activations = partial(_kernel, cfg=cfg, matmul=pallas_kernels.fp8_activation_matmul)
        return w.apply(fp8_activations, x) if isinstance(w, LayerWeight) else fp8_activations(w, x)
    if isinstance(w, (QuantizedWeight, LayerSlice)) and w.blocked():
        kernel = (partial(_kernel, cfg=cfg, matmul=pallas_kernels.quantized_matmul)
                  if cfg is not None and w.fmt == FP8 else _blocked)
        return jax.lax.platform_dependent(w, x, cpu=_dense_whole, tpu=kernel, cuda=kernel, default=_blocked)
    return with_weight(_dense_whole, w, x)


def _fp8(w) -> bool:
    """Whether w (any form `dense` takes) is an FP8 QuantizedWeight."""
    w = w.parts[0] if isinstance(w, LayerWeight) else w.stack if isinstance(w, LayerSlice) else w
    return isinstance(w, QuantizedWeight) and w.fmt == FP8


def _blocked(w, x: jnp.ndarray) -> jnp.ndarray:
    w = own_weight(w)
    return w.matmul(x.astype(w.dtype)).astype(w.dtype)


def _kernel(w, x: jnp.ndarray, cfg: ModelConfig, matmul) -> jnp.ndarray:
    """`matmul` (`pallas_kernels.quantized_matmul` or `fp8_activation_matmul`), per device on a
    mesh (see the module doc); a LayerSlice read in place in its stack."""
    stacked = isinstance(w, LayerSlice)
    q = w.stack if stacked else w
    out_axis, in_axis = q.axes
    mesh = active(cfg)
    summed = cfg.layout.axes(in_axis, mesh) if mesh is not None else ()
    if summed and matmul is pallas_kernels.quantized_matmul:
        return _blocked(w, x)
    x_axes = (rows_axis(cfg, x.shape[0]),) + (None,) * (x.ndim - 2) + (in_axis,)
    out_axes = x_axes[:-1] + (out_axis,)
    multiply = partial(matmul, impl=cfg.attention_impl)
    if summed:
        multiply = partial(_summed, multiply, summed)
    if stacked:
        run = per_device(cfg, lambda x, q, i: multiply(x, q, layer=i), (x_axes, (None,) + q.axes, None), out_axes)
        return run(x.astype(q.dtype), q, w.index)
    return per_device(cfg, multiply, (x_axes, q.axes), out_axes)(x.astype(q.dtype), q)


def _summed(matmul, axes, x, w, **kw):
    """matmul's partial product over this device's share of the input dim, summed over `axes`
    in fp32 and rounded once."""
    return jax.lax.psum(matmul(x, w, **kw).astype(jnp.float32), axes).astype(x.dtype)


def _dense_whole(w, x: jnp.ndarray) -> jnp.ndarray:
    wd = weight_array(own_weight(w))
    x = x.astype(wd.dtype)
    if _in_halves(x, wd):
        n, k = wd.shape
        xs = jnp.broadcast_to(x, (2,) + x.shape)
        y = jnp.einsum("p...i,poi->...po", xs, wd.reshape(2, n // 2, k),
                       preferred_element_type=jnp.float32).reshape(*x.shape[:-1], n)
    else:
        y = jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32)
    return y.astype(wd.dtype)


# A weight of at least this many elements, multiplied by few enough rows that the product stays under
# HALVES_MAX_PRODUCT multiply-adds, goes as a batch of two half-weight products on CPU (`_in_halves`).
HALVES_MIN_ELEMENTS = 1 << 17
HALVES_MAX_PRODUCT = 1 << 20


def _in_halves(x: jnp.ndarray, w: jnp.ndarray) -> bool:
    """Whether to multiply by w as two halves of its rows in one batched product: XLA:CPU runs a
    product of a few rows by a 1-4 MB (fp32) weight on one thread, and the batched form on both
    (decode's projections: about 1.6x). Larger products are threaded already; TPU and GPU need
    none of this."""
    rows = math.prod(x.shape[:-1])
    return (jax.default_backend() == "cpu" and w.ndim == 2 and w.shape[0] % 2 == 0
            and w.size >= HALVES_MIN_ELEMENTS and rows * w.size < HALVES_MAX_PRODUCT)
