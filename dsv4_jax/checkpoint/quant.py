"""FP8 (e4m3, 128x128 block scales) and FP4 (e2m1 packed in I8, per-32 scales) weights of the
published DeepSeek-V4 checkpoints: exact dequantization, and the quantizers used to build
synthetic quantized checkpoints for tests.

* FP8: weight F8_E4M3 [out, in], scale [ceil(out/128), ceil(in/128)], either F8_E8M0 (byte b means
  2^(b-127), 255 is NaN) or a float (Flash-Base ships float32 scales). W = e4m3 * scale[o//128, i//128].
* FP4: weight I8 [out, in/2]; element 2i is the LOW nibble of byte i, element 2i+1 the HIGH nibble.
  Nibble n: sign = bit 3, magnitude [0, 0.5, 1, 1.5, 2, 3, 4, 6][n & 7]. Scale F8_E8M0
  [out, ceil(in/32)] (the published checkpoints have in a multiple of 32; a ragged last group is
  accepted, as the FP8 blocks accept ragged edges).

Dequantization computes in float32, where every product of an e4m3/e2m1 value and a power-of-two
scale is exact, then rounds once to the target dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_BLOCK = 128
FP4_GROUP = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
_FP4_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_VALUES = np.concatenate([_FP4_MAG, -_FP4_MAG]).astype(np.float32)  # code -> value (code 8 is -0.0)


class QuantError(ValueError):
    pass


def scale_values(scale: np.ndarray) -> np.ndarray:
    """Scales as float32: E8M0 bytes b -> 2^(b-127) (b = 255 -> NaN); float scales as they are."""
    scale = np.asarray(scale)
    if scale.dtype == ml_dtypes.float8_e8m0fnu or scale.dtype == np.uint8:
        b = scale.view(np.uint8).astype(np.int32)
        out = np.ldexp(np.float32(1.0), b - 127).astype(np.float32)
        out[b == 255] = np.nan
        return out
    if scale.dtype.kind == "f" or scale.dtype == ml_dtypes.bfloat16:
        return scale.astype(np.float32)
    raise QuantError(f"unsupported scale dtype {scale.dtype}")


def fp8_scale_shape(shape) -> tuple[int, int]:
    out, inp = shape
    return (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))


def fp4_scale_shape(packed_shape) -> tuple[int, int]:
    out, half = packed_shape
    return (out, -(-2 * half // FP4_GROUP))


def _expand(s: np.ndarray, rows: int, cols: int, br: int, bc: int) -> np.ndarray:
    return np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:rows, :cols]


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """e4m3 [out, in] times 128x128 block scales -> dtype [out, in]."""
    weight = np.asarray(weight)
    if weight.dtype != ml_dtypes.float8_e4m3fn:
        raise QuantError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.ndim != 2:
        raise QuantError(f"FP8 weight must be 2-D, got shape {list(weight.shape)}")
    if tuple(scale.shape) != fp8_scale_shape(weight.shape):
        raise QuantError(f"FP8 scale has shape {list(scale.shape)}, weight {list(weight.shape)} needs "
                         f"{list(fp8_scale_shape(weight.shape))}")
    s = _expand(scale_values(scale), *weight.shape, FP8_BLOCK, FP8_BLOCK)
    out = weight.astype(np.float32) * s
    return out.astype(dtype, copy=False)


def unpack_fp4_codes(packed: np.ndarray) -> np.ndarray:
    """I8 [out, in/2] -> uint8 nibble codes [out, in] (low nibble first)."""
    b = np.asarray(packed).view(np.uint8)
    codes = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    codes[..., 0::2] = b & 0x0F
    codes[..., 1::2] = b >> 4
    return codes


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Packed e2m1 I8 [out, in/2] times per-32 scales [out, in/32] -> dtype [out, in]."""
    packed = np.asarray(packed)
    if packed.dtype not in (np.int8, np.uint8):
        raise QuantError(f"FP4 weight must be I8-packed, got {packed.dtype}")
    if packed.ndim != 2:
        raise QuantError(f"FP4 weight must be 2-D, got shape {list(packed.shape)}")
    if tuple(scale.shape) != fp4_scale_shape(packed.shape):
        raise QuantError(f"FP4 scale has shape {list(scale.shape)}, packed weight {list(packed.shape)} "
                         f"needs {list(fp4_scale_shape(packed.shape))}")
    vals = FP4_VALUES[unpack_fp4_codes(packed)]
    vals *= np.repeat(scale_values(scale), FP4_GROUP, axis=1)[:, :vals.shape[1]]
    return vals.astype(dtype, copy=False)


# ---- quantizers (for building synthetic checkpoints) ------------------------------------------

def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """ceil(log2(amax / qmax)) computed exactly (frexp), clipped to the E8M0 range; 0 for amax 0."""
    x = amax.astype(np.float64) / qmax
    m, e = np.frexp(x)
    e = np.where(m == 0.5, e - 1, e)
    e = np.where(x > 0, e, 0)
    return np.clip(e, -127, 127).astype(np.int32)


def _e8m0(exp: np.ndarray) -> np.ndarray:
    return (exp + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (e4m3 [out, in], E8M0 scales [ceil(out/128), ceil(in/128)]), with
    scale = 2^ceil(log2(amax/448)) per block and round-to-nearest-even values."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    R, C = fp8_scale_shape(w.shape)
    padded = np.zeros((R * FP8_BLOCK, C * FP8_BLOCK), np.float32)
    padded[:out, :inp] = np.abs(w)
    amax = padded.reshape(R, FP8_BLOCK, C, FP8_BLOCK).max(axis=(1, 3))
    exp = _pow2_exponent(amax, FP8_MAX)
    q = (w / _expand(np.ldexp(np.float32(1.0), exp).astype(np.float32), out, inp, FP8_BLOCK, FP8_BLOCK))
    return q.astype(ml_dtypes.float8_e4m3fn), _e8m0(exp)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (I8 packed [out, in/2], E8M0 scales [out, in/32]), with
    scale = 2^ceil(log2(amax/6)) per 32 inputs and round-to-nearest-even values."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    if inp % 2:
        raise QuantError(f"FP4 packs two values per byte: the input dim must be even, got {inp}")
    G = -(-inp // FP4_GROUP)
    padded = np.zeros((out, G * FP4_GROUP), np.float32)
    padded[:, :inp] = np.abs(w)
    amax = padded.reshape(out, G, FP4_GROUP).max(axis=-1)
    exp = _pow2_exponent(amax, FP4_MAX)
    x = w / np.repeat(np.ldexp(np.float32(1.0), exp).astype(np.float32), FP4_GROUP, axis=1)[:, :inp]
    codes = _round_to_fp4_codes(x)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, _e8m0(exp)


def _round_to_fp4_codes(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto e2m1 (|x| <= 6 assumed; larger saturates) -> nibble codes."""
    a = np.minimum(np.abs(x), FP4_MAX)
    mags = _FP4_MAG
    idx = np.searchsorted(mags, a, side="left")  # mags[idx-1] < a <= mags[idx]
    idx = np.clip(idx, 1, len(mags) - 1)
    lo, hi = mags[idx - 1], mags[idx]
    take_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (idx % 2 == 0))  # even code wins a tie
    code = np.where(take_hi, idx, idx - 1).astype(np.uint8)
    code = np.where(a == 0, 0, code).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)
