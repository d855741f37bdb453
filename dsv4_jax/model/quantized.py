"""Weights kept quantized in memory (`dsv4-convert --dtype native`), dequantized inside the matmuls.

`QuantizedWeight` is a pytree (flax struct dataclass) of two arrays with the same leading
(stacked: layers, experts) axes, so `jax.tree.map` slicing, `lax.scan` over the layer stack and
`w[expert_ids]` all work on it as on a plain array:

* FP8 (`fmt="fp8"`): values float8_e4m3fn `[..., out, in]`, scale float32 `[..., ceil(out/128),
  ceil(in/128)]` (128x128 blocks; E8M0 scales are stored as the float32 powers of two they mean,
  float scales as they are);
* FP4 (`fmt="fp4"`): values uint8 `[..., out, in/2]` (two e2m1 codes per byte, element 2i in the
  low nibble), scale uint8 `[..., out, ceil(in/32)]` (the E8M0 exponent byte b, meaning 2^(b-127)).

`axes` (static) are the logical axes (dsv4_jax/model/sharding.py) of the weight's last two dims
`[out, in]`, by which the matmul kernels run per device on a mesh (the loader sets them).

`dtype` (static) is the compute dtype: `dequantize()` multiplies values and scales in float32,
where every product is exact for power-of-two scales (one IEEE rounding for float scales, as the
converter's numpy dequantization does), then rounds once to `dtype`. So a weight dequantized here
is bit for bit the one `dsv4-convert --dtype float32|bfloat16` writes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FP8, FP4 = "fp8", "fp4"
FP8_BLOCK = 128
FP4_GROUP = 32


def storage_shapes(shape: tuple[int, ...], fmt: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The stored arrays of a quantized weight of logical shape `[..., out, in]`:
    {"values": (shape, dtype), "scale": (shape, dtype)}."""
    import ml_dtypes

    *lead, out, inp = shape
    lead = tuple(lead)
    if fmt == FP8:
        return {"values": (tuple(shape), np.dtype(ml_dtypes.float8_e4m3fn)),
                "scale": (lead + (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)), np.dtype(np.float32))}
    if fmt == FP4:
        if inp % 2:
            raise ValueError(f"FP4 packs two values per byte: input dim {inp} is odd")
        return {"values": (lead + (out, inp // 2), np.dtype(np.uint8)),
                "scale": (lead + (out, -(-inp // FP4_GROUP)), np.dtype(np.uint8))}
    raise ValueError(f"unknown quantized format {fmt!r}")


def e8m0_to_float32(b: jnp.ndarray) -> jnp.ndarray:
    """E8M0 exponent bytes (uint8) -> float32 2^(b-127), exactly (b = 0 is the subnormal 2^-127;
    b = 255 is NaN)."""
    b = b.astype(jnp.uint32)
    v = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    v = jnp.where(b == 0, jnp.float32(2.0 ** -127), v)
    return jnp.where(b == 255, jnp.float32(jnp.nan), v)


def _expand(s: jnp.ndarray, rows: int, cols: int, br: int, bc: int) -> jnp.ndarray:
    if br > 1:
        s = jnp.repeat(s, br, axis=-2)
    if bc > 1:
        s = jnp.repeat(s, bc, axis=-1)
    return s[..., :rows, :cols]


@struct.dataclass
class QuantizedWeight:
    """A block-scaled FP8 or FP4 weight `[..., out, in]` (see the module doc)."""

    values: jnp.ndarray
    scale: jnp.ndarray
    fmt: str = struct.field(pytree_node=False, default=FP8)
    dtype_name: str = struct.field(pytree_node=False, default="float32")
    axes: tuple = struct.field(pytree_node=False, default=(None, None))

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (what `dequantize()` returns and what matmuls run in)."""
        return jnp.dtype(self.dtype_name)

    @property
    def shape(self) -> tuple[int, ...]:
        s = tuple(self.values.shape)
        return s[:-1] + (2 * s[-1],) if self.fmt == FP4 else s

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        return int(self.values.size * self.values.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    def __getitem__(self, idx) -> "QuantizedWeight":
        """Indexes the leading (stacked) axes only: `w[layer]`, `w[expert_ids]`, `w[i, e]`."""
        n = len(idx) if isinstance(idx, tuple) else 1
        if n > self.ndim - 2 or idx is Ellipsis or (isinstance(idx, tuple) and Ellipsis in idx):
            raise IndexError(f"QuantizedWeight{list(self.shape)}: only the {self.ndim - 2} leading axes can be "
                             f"indexed, got {idx!r}")
        return self.replace(values=self.values[idx], scale=self.scale[idx])

    def astype(self, dtype) -> "QuantizedWeight":
        """The same stored weight with another compute dtype (nothing is dequantized here)."""
        return self.replace(dtype_name=jnp.dtype(dtype).name)

    def blocked(self) -> bool:
        """Whether `matmul` keeps the scale blocks as axes: a 2-d weight whose dims the blocks
        divide (the published models' linears all are)."""
        return self.ndim == 2 and blocks_divide(self.shape, self.fmt)

    def matmul(self, x: jnp.ndarray) -> jnp.ndarray:
        """x `[..., in]` (in the compute dtype) times the weight: fp32 `[..., out]`, the very
        products and sums of `x @ dequantize().T` (same values, same contraction order), with
        the weight kept in its scale blocks (FP8: `[out/128, 128, in/128, 128]`, FP4:
        `[out, in/32, 16, 2]`, the two codes of a byte as the last axis) and x viewed the same
        way, so that the dequantization is a broadcast the compiler fuses into the product
        instead of a whole weight written out (a TPU re-lays out an `[out, in]` weight built
        by interleaving nibbles or repeating scales). Needs `blocked()`."""
        out, inp = self.shape
        lead = x.shape[:-1]
        if self.fmt == FP8:
            ob, ib = out // FP8_BLOCK, inp // FP8_BLOCK
            w = self.values.reshape(ob, FP8_BLOCK, ib, FP8_BLOCK).astype(jnp.float32)
            w = (w * self.scale.astype(jnp.float32)[:, None, :, None]).astype(self.dtype)
            y = jnp.einsum("...jk,oijk->...oi", x.reshape(lead + (ib, FP8_BLOCK)), w,
                           preferred_element_type=jnp.float32)
            return y.reshape(lead + (out,))
        groups = inp // FP4_GROUP
        codes = jax.lax.bitcast_convert_type(self.values.reshape(out, groups, FP4_GROUP // 2), jnp.float4_e2m1fn)
        w = (codes.astype(jnp.float32) * e8m0_to_float32(self.scale)[..., None, None]).astype(self.dtype)
        return jnp.einsum("...gkp,ogkp->...o", x.reshape(lead + (groups, FP4_GROUP // 2, 2)), w,
                          preferred_element_type=jnp.float32)

    def dequantize(self, dtype=None) -> jnp.ndarray:
        """The weight `[..., out, in]` in `dtype` (default: the compute dtype), computed in fp32
        then rounded once."""
        dtype = self.dtype if dtype is None else jnp.dtype(dtype)
        out, inp = self.shape[-2:]
        if self.fmt == FP8:
            s = self.scale.astype(jnp.float32)
            w = self.values.astype(jnp.float32) * _expand(s, out, inp, FP8_BLOCK, FP8_BLOCK)
        elif self.fmt == FP4:  # a byte's two e2m1 codes, low nibble first, as float4 values
            codes = jax.lax.bitcast_convert_type(self.values.astype(jnp.uint8), jnp.float4_e2m1fn)
            w = codes.reshape(self.values.shape[:-1] + (inp,)).astype(jnp.float32)
            w = w * _expand(e8m0_to_float32(self.scale), out, inp, 1, FP4_GROUP)
        else:
            raise ValueError(f"unknown quantized format {self.fmt!r}")
        return w.astype(dtype)


def blocks_divide(shape: tuple[int, ...], fmt: str) -> bool:
    """Whether the scale blocks of `fmt` divide a weight `[..., out, in]` of this shape."""
    out, inp = shape[-2:]
    return (out % FP8_BLOCK == 0 and inp % FP8_BLOCK == 0) if fmt == FP8 else inp % FP4_GROUP == 0


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def dequantize_tree(tree, dtype=None):
    """Every QuantizedWeight of a tree replaced by its dequantized array."""
    return jax.tree.map(lambda x: x.dequantize(dtype) if is_quantized(x) else x, tree, is_leaf=is_quantized)
