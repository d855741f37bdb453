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
* CPU: the whole dequantized weight (bit for bit a dequantized checkpoint's products and sums;
  `xla_cpu.dense`).

With `ModelConfig.fp8_activations` an FP8 weight's input is quantized to e4m3 per 128 columns
first and the products are DeepSeek's reference `fp8_gemm`'s (`pallas_kernels.fp8_activation_matmul`:
the FP8 tensor-core kernel on CUDA, its plain-JAX twin elsewhere), on every platform, per
device on a mesh (a row-parallel weight's partial products summed over the devices that split
its input: the quantization blocks of 128 columns stay whole on a device).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

import pallas_kernels  # looked up at call time: pallas_kernels imports our primitives
from . import xla_cpu
from .config import ModelConfig
from .layer_weights import LayerSlice, LayerWeight, own_weight
from .quantized import FP8, QuantizedWeight
from .sharding import active, per_device, rows_axis


def weight_array(w) -> jnp.ndarray:
    """w itself, or a QuantizedWeight dequantized to its compute dtype."""
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def dense(x: jnp.ndarray, w, cfg: ModelConfig | None = None) -> jnp.ndarray:
    """x `[..., in]`, w `[out, in]` (array, QuantizedWeight, LayerSlice or LayerWeight) ->
    `[..., out]` in w's dtype. cfg, the model's, lets a quantized weight take the matmul kernel
    on TPU and GPU (its `attention_impl` choice, per device on its mesh); code already running
    per device passes none."""
    product = None
    if cfg is not None and cfg.fp8_activations and _fp8(w):
        product = partial(_kernel, cfg=cfg, matmul=pallas_kernels.fp8_activation_matmul)
    return xla_cpu.choose(w, x, cpu=partial(xla_cpu.dense, product=product),
                          device=product or partial(_on_device, cfg=cfg))


def _on_device(w, x: jnp.ndarray, cfg: ModelConfig | None) -> jnp.ndarray:
    """`dense` on TPU and GPU: a blocked FP8 weight by the matmul kernel (given cfg), any other
    quantized one by its scale blocks, a plain one by XLA's product."""
    if isinstance(w, (QuantizedWeight, LayerSlice)) and w.blocked():
        if cfg is not None and w.fmt == FP8:
            return _kernel(w, x, cfg, pallas_kernels.quantized_matmul)
        return _blocked(w, x)
    wd = weight_array(own_weight(w))
    return jnp.einsum("...i,oi->...o", x.astype(wd.dtype), wd, preferred_element_type=jnp.float32).astype(wd.dtype)


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
