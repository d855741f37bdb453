"""DeepSeek-V4's FP8 KV-cache record: FlashMLA's `fp8_ds_mla` layout of one compressed KV entry.

An entry of head_dim D = nope + rope values (the last `rope` are the RoPE part) is stored as one
byte record, so that the cache's compressed entries take about half of bf16's bytes (584 B against
1024 B per DeepSeek-V4-Flash entry, D=512, rope=64) and FlashMLA's FP8 kernels can read them:

    [0, nope)                       nope values as float8 e4m3fn codes, one scale per 64 of them
    [nope, nope + 2 rope)           rope values as bfloat16, little-endian, unchanged: RoPE'd
                                    dimensions carry position and lose too much in FP8
    next ceil(nope / 64)            UE8M0 scales, byte b meaning 2^(b - 127)
    then zeros up to a multiple of 8 bytes

The nope values are quantized as DeepSeek's reference `act_quant` does with scale_fmt "ue8m0" and
blocks of 64 (a last partial block is one block of the values left): per block, in float32,
amax = max(max|x|, 1e-4), scale s = 2^ceil(log2(amax * float32(1/448))) taken from the float32
bit fields, code q = e4m3(clamp(x / s, -448, 448)) rounded to nearest even; it means q * s, exact
in float32 and in bfloat16 since s is a power of two. (Past 448 * 2^119, about 3e38, the scale is
2^120 and a code rounded up to 256 or more means more than float32 holds: inf.)

`rope_dim` and `head_dim` fix the layout, so they are static under `jax.jit`.

The cache keeps records as 32-bit words (`to_words`, `from_words`: the same bytes): a TPU tiles an
8-bit array in (32, 128) tiles and its scatter works on (8, 128) ones, so a uint8 pool would be
copied whole around every write of a step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 64
PLANES = 4  # bytes of a record word: the byte planes the TPU kernels decode
_E4M3_MAX = 448.0


def layout(head_dim: int, rope_dim: int) -> tuple[int, int, int]:
    """(nope, number of scale blocks, record bytes) of a head_dim / rope_dim entry."""
    nope = head_dim - rope_dim
    blocks = -(-nope // BLOCK)
    return nope, blocks, -(-(nope + 2 * rope_dim + blocks) // 8) * 8


def record_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one record: 584 for DeepSeek-V4-Flash (512, 64)."""
    return layout(head_dim, rope_dim)[2]


def _quantize(nope: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """nope values `[..., n]` -> (e4m3 codes `[..., blocks, 64]`, scale exponents int32 `[..., blocks]`).

    The codes of a last partial block's padding are those of zeros, which the callers drop."""
    n = nope.shape[-1]
    blocks = -(-n // BLOCK)
    x = nope.astype(jnp.float32)
    # Zero padding leaves every block's amax as it is: amax is floored above zero anyway.
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * BLOCK - n)])
    x = x.reshape(*x.shape[:-1], blocks, BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), jnp.float32(1e-4))
    y = jax.lax.bitcast_convert_type(amax * jnp.float32(1 / _E4M3_MAX), jnp.int32)
    # ceil(log2 y) from the bit fields, as the reference does, so no log's rounding can move it.
    exponent = ((y >> 23) & 0xFF) - 127 + ((y & 0x7FFFFF) != 0).astype(jnp.int32)
    scale = _pow2(exponent)
    q = jnp.clip(x / scale[..., None], -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, exponent


def _pow2(exponent: jnp.ndarray) -> jnp.ndarray:
    """2^e as float32 for e in the normal range, built from its bits. Finite inputs give
    e in [-22, 120] (amax from 1e-4 up to float32's largest), well inside it."""
    return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def _dequantize(q: jnp.ndarray, exponent: jnp.ndarray, n: int) -> jnp.ndarray:
    """(codes `[..., blocks, 64]`, exponents `[..., blocks]`) -> float32 `[..., n]`."""
    x = q.astype(jnp.float32) * _pow2(exponent)[..., None]
    return x.reshape(*x.shape[:-2], -1)[..., :n]


def e4m3_values(code):
    """int32 e4m3fn codes 0..255 -> their float32 values by integer ops and a bitcast, as the TPU
    kernels decode records (NaN codes are never written)."""
    sign = (code & 0x80) << 24
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = lax.bitcast_convert_type(sign | ((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * jnp.float32(2.0 ** -9)
    return jnp.where(exponent == 0, jnp.where(sign != 0, -subnormal, subnormal), normal)


def decode_planes(words, nope_words: int, rope_words: int, scale_word: int, scales: int) -> list:
    """A block of records as words int32 `[BK, W]` (nope_words words of NoPE codes, rope_words of
    RoPE values, `scales` scale bytes from word scale_word) -> the values of its PLANES planes, as
    the TPU kernels decode records: fp32 `[BK, W]` each, column i of plane j holding NoPE dim
    4i + j (times its block's scale); planes 0 / 1 in the RoPE columns the word's even / odd dim;
    zero elsewhere. Integer ops, bitcasts and masks only: no byte moves between lanes."""
    col = lax.broadcasted_iota(jnp.int32, words.shape, 1)
    rope_end = nope_words + rope_words
    scale_words = [jnp.max(jnp.where(col == scale_word + i, words, jnp.iinfo(jnp.int32).min), axis=1,
                           keepdims=True) for i in range(-(-scales // PLANES))]  # [BK, 1] each
    scale = jnp.zeros(words.shape, jnp.float32)
    per_scale = BLOCK // PLANES  # words of a 64-value scale block
    for blk in range(scales):
        biased = (scale_words[blk // PLANES] >> (8 * (blk % PLANES))) & 0xFF  # 2^(b - 127): b in the exponent field
        scale = jnp.where((col >= blk * per_scale) & (col < (blk + 1) * per_scale),
                          lax.bitcast_convert_type(biased << 23, jnp.float32), scale)
    is_nope = col < nope_words
    is_rope = (col >= nope_words) & (col < rope_end)
    rope = (lax.bitcast_convert_type(words << 16, jnp.float32),
            lax.bitcast_convert_type(words & jnp.int32(-65536), jnp.float32))  # low half: the even dim
    planes = []
    for j in range(PLANES):
        value = jnp.where(is_nope, e4m3_values((words >> (8 * j)) & 0xFF) * scale, 0.0)
        planes.append(jnp.where(is_rope, rope[j], value) if j < 2 else value)
    return planes


def encode(x: jnp.ndarray, rope_dim: int) -> jnp.ndarray:
    """Entries `[..., D]` (bfloat16 or float32) -> records uint8 `[..., record_bytes(D, rope_dim)]`."""
    nope, blocks, size = layout(x.shape[-1], rope_dim)
    q, exponent = _quantize(x[..., :nope])
    lead = x.shape[:-1]
    codes = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(*lead, blocks * BLOCK)[..., :nope]
    rope = jax.lax.bitcast_convert_type(x[..., nope:].astype(jnp.bfloat16), jnp.uint8).reshape(*lead, 2 * rope_dim)
    scales = (exponent + 127).astype(jnp.uint8)
    pad = jnp.zeros((*lead, size - nope - 2 * rope_dim - blocks), jnp.uint8)
    return jnp.concatenate([codes, rope, scales, pad], axis=-1)


def decode(rec: jnp.ndarray, head_dim: int, rope_dim: int, dtype=jnp.bfloat16) -> jnp.ndarray:
    """Records uint8 `[..., R]` -> entries `[..., head_dim]` in `dtype`."""
    nope, blocks, _ = layout(head_dim, rope_dim)
    lead = rec.shape[:-1]
    codes = jnp.pad(rec[..., :nope], [(0, 0)] * len(lead) + [(0, blocks * BLOCK - nope)])
    q = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).reshape(*lead, blocks, BLOCK)
    exponent = rec[..., nope + 2 * rope_dim: nope + 2 * rope_dim + blocks].astype(jnp.int32) - 127
    rope = rec[..., nope: nope + 2 * rope_dim].reshape(*lead, rope_dim, 2)
    rope = jax.lax.bitcast_convert_type(rope, jnp.bfloat16)
    return jnp.concatenate([_dequantize(q, exponent, nope).astype(dtype), rope.astype(dtype)], axis=-1)


def read(rows: jnp.ndarray, head_dim: int, rope_dim: int, dtype) -> jnp.ndarray:
    """Rows as a cache holds them -> their values: records as words (uint32 `[..., R / 4]`,
    `to_words`) decoded to `[..., head_dim]` in dtype; rows of values as they are."""
    if rows.dtype != jnp.uint32:
        return rows
    return decode(from_words(rows), head_dim, rope_dim, dtype)


def to_words(rec: jnp.ndarray) -> jnp.ndarray:
    """Records uint8 `[..., R]` (R a multiple of 4, as record_bytes gives) -> uint32 `[..., R / 4]`
    holding the same bytes."""
    return jax.lax.bitcast_convert_type(rec.reshape(*rec.shape[:-1], rec.shape[-1] // 4, 4), jnp.uint32)


def from_words(words: jnp.ndarray) -> jnp.ndarray:
    """uint32 `[..., W]` as `to_words` gives -> the records uint8 `[..., 4 W]`."""
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*words.shape[:-1], 4 * words.shape[-1])
