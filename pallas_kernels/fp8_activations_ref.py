"""DeepSeek's reference FP8 linear in plain JAX: activations quantized per row and 128-wide K block
(`act_quant`, ../shared/docs/architecture.md section 2.4), then the FP8 GEMM's block-wise accumulation
(section 2.7).

Both are exact emulations of the reference's arithmetic, not approximations of it: the e4m3
products are exact in fp32 (4 x 4 significant bits), so what remains is the order of the fp32
sums inside a block (which the GPU kernel changes, and on a GPU also their precision: see
fp8_activations_gpu.py) and the fixed order of the per-block partials, scaled and added in K
order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # the K block of activation and weight scales
FP8_MAX = 448.0  # the largest finite e4m3 value
AMAX_FLOOR = 1e-4  # the reference's floor on a block's amax (an all-zero block gets a finite scale)
_MANTISSA_BITS = 23
_EXPONENT_BIAS = 127


def act_quant(x, block: int = BLOCK):
    """x `[..., K]` (bf16 or fp32) -> (q float8_e4m3fn `[..., K]`, s float32 `[..., ceil(K/block)]`),
    x ~ q * s per block of `block` columns (the last one partial when block does not divide K).

    As the reference computes it: amax = max |x| over the block in fp32, floored at 1e-4;
    y = amax * fp32(1/448); s = 2^e with e = exponent_bits(y) - 127 + (mantissa_bits(y) != 0),
    i.e. 2^ceil(log2 y) read off y's bits; q = e4m3 round-to-nearest-even of clamp(x / s, -448,
    448), the division in fp32. s is a power of two, so x / s is the fp32 product of x and 2^-e
    (built from bits as well; both are the one rounding of the same value, exact unless it is
    below fp32's normal range, where e4m3 has only zero), and the cast to e4m3 rounds once more."""
    *lead, k = x.shape
    blocks = -(-k // block)
    xf = x.astype(jnp.float32)
    # Zero columns past K: they change no block's amax (floored at 1e-4 anyway) and are cut off.
    xb = jnp.pad(xf, [(0, 0)] * len(lead) + [(0, blocks * block - k)]).reshape(*lead, blocks, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), jnp.float32(AMAX_FLOOR))
    bits = jax.lax.bitcast_convert_type(amax * jnp.float32(1 / FP8_MAX), jnp.uint32)
    exponent = (bits >> _MANTISSA_BITS).astype(jnp.int32) & 0xFF
    round_up = ((bits & ((1 << _MANTISSA_BITS) - 1)) != 0).astype(jnp.int32)
    e = exponent - _EXPONENT_BIAS + round_up
    s = _pow2(e)
    q = jnp.clip(xb * _pow2(-e)[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(*lead, blocks * block)[..., :k], s


def act_quant_rounded(x, block: int = BLOCK):
    """x as `act_quant` rounds it, in x's dtype: q s per block (exact in bf16 and fp32: 4
    significant bits times a power of two)."""
    q, s = act_quant(x, block)
    scales = jnp.repeat(s, block, axis=-1)[..., :x.shape[-1]]
    return (q.astype(jnp.float32) * scales).astype(x.dtype)


def _pow2(e):
    """float32 2^e for int32 e in the normal range [-126, 127], from its bits. y = amax/448 lies in
    [2.2e-7, 7.6e35] (amax floored at 1e-4, at most bf16's and fp32's 3.4e38, x finite), so e
    lies in [-22, 120] and -e in [-120, 22]."""
    return jax.lax.bitcast_convert_type((e + _EXPONENT_BIAS).astype(jnp.uint32) << _MANTISSA_BITS, jnp.float32)


def fp8_activation_matmul_ref(x, w):
    """x `[M, K]` (bf16 or fp32) times w (a 2-d FP8 `QuantizedWeight` `[N, K]`, dsv4_jax/model/quantized.py)
    transposed, with x quantized by `act_quant`: `[M, N]` in x's dtype.

    For each 128-wide K block kb, in K order: the block's product q_x @ q_w.T with fp32 sums,
    times s_x[:, kb] * s_w[nb, kb] (the two scales multiplied first), added into an fp32
    accumulator; rounded once to x's dtype at the end. The e4m3 operands go into the dot as
    they are: TPU v7x's MXU multiplies FP8; XLA widens them on chip for MXUs that take none
    (v5e, v5p, v6e) and to fp32 on CPU. The products are exact either way (4 x 4 significant
    bits)."""
    m, k = x.shape
    n = w.shape[0]
    q, s = act_quant(x)
    blocks = s.shape[-1]
    qw = w.values
    if k % BLOCK:  # the last block partial: multiplied by zeros past K (a padded copy, at such K only)
        q, qw = (jnp.pad(a, ((0, 0), (0, blocks * BLOCK - k))) for a in (q, qw))
    s_w = jnp.repeat(w.scale.astype(jnp.float32), BLOCK, axis=0)[:n]  # [N, Kb]: each output row's scales

    # The blocks in a loop unrolled at trace time, not one einsum into [Kb, M, N] partials: that
    # would be Kb times the output's memory (56 x 60 MiB for a 2048-token chunk of a 7168-wide
    # projection). The slices are static and 128-aligned, so each dot reads its block of the
    # weight in place (a traced block index makes a TPU re-lay out the whole weight first).
    acc = jnp.zeros((m, n), jnp.float32)
    for b in range(blocks):
        xb, wb = (a[:, b * BLOCK:(b + 1) * BLOCK] for a in (q, qw))
        part = jnp.einsum("mk,nk->mn", xb, wb, preferred_element_type=jnp.float32)
        acc = acc + part * (s[:, b, None] * s_w[None, :, b])
    return acc.astype(x.dtype)
