"""KV compressor (gated pooling + RMSNorm; RoPE in the wrapper): the Mosaic GPU kernel (Hopper,
CUDA cores only).

Grid `(B, n)`: one block (one warpgroup, 128 threads) per compressed entry. Every candidate of an
entry is one feature row of d fp32 values, read straight from GMEM into registers in the
`WG_STRIDED` layout (each thread holds d / 128 consecutive channels, so the loads are coalesced
and vectorised); no SMEM, no TMA, no barriers. The pooling is then elementwise across the
candidate rows, per channel, in fp32:
  * ratio 4: 8 candidates, all in registers at once: the previous block's 4 token rows (features
    [0, d)) and this block's 4 token rows (features [d, 2d)). For entry 0 the previous block is
    prev_a / prev_z, or no block at all (a = 0, z = -inf: weight 0), chosen by a select on the
    entry index; the (clamped) in-bounds row of a / z that the select discards is still read.
  * ratio 128: two passes over the 128 rows of the entry (max of z; then sum of exp and the
    exp-weighted sum of a), the second pass re-reading z (from L2 in practice).
The pooled entry is rounded to out_dtype, RMS-normalised over d (a full-array reduction of the
strided registers, fp32), multiplied by the weight in fp32 and rounded again, as the reference.

RoPE (interleaved pairs on the last rope dims) is applied afterwards in the wrapper, in plain JAX
with the same `apply_rope` as the reference: the strided register layout holds each pair in one
thread but Mosaic GPU has no in-register lane permutation to swap the pair members. This costs one
extra read + write of the [B, n, d] output in an XLA fusion (d * 2 bytes each way per bf16 entry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .compressor_ref import compress_ref
from .numerics import apply_rope

HAVE_KERNEL = True

WARPGROUP = 128


def supported(d: int) -> bool:
    return d % WARPGROUP == 0


def _vec(d: int) -> int:
    return min(4, d // WARPGROUP)  # fp32 channels per thread and vector load (16 bytes at most)


def _kernel(a_g, z_g, w_g, *rest, ratio: int, d: int, eps: float, has_prev: bool, interpret: bool):
    if has_prev:
        pa_g, pz_g, o_g = rest
    else:
        (o_g,) = rest
    b = lax.axis_index("b")
    j = lax.axis_index("j")
    f32 = jnp.float32
    layout = plgpu.Layout.WG_STRIDED((d,), vec_size=_vec(d))
    cast = (lambda x: x) if interpret else (lambda x: plgpu.layout_cast(x, layout))

    def row(ref, r, lo):  # one token row's d features [lo, lo + d): [d] fp32
        return cast(ref[b, r, pl.ds(lo, d)]).astype(f32)

    if ratio == 4:
        first = j == 0
        prev_row = jnp.maximum(j - 1, 0) * ratio  # clamped so that entry 0 reads in bounds

        def before(ref, p_ref, r, empty):
            x = row(ref, prev_row + r, 0)
            edge = row(p_ref, r, 0) if has_prev else empty
            return jnp.where(first, edge, x)

        zs = ([before(z_g, pz_g if has_prev else None, r, -jnp.inf) for r in range(4)]
              + [row(z_g, j * ratio + r, d) for r in range(4)])
        avals = ([before(a_g, pa_g if has_prev else None, r, 0.0) for r in range(4)]
                 + [row(a_g, j * ratio + r, d) for r in range(4)])
        m = functools.reduce(jnp.maximum, zs)
        es = [jnp.exp(zr - m) for zr in zs]
        s = functools.reduce(jnp.add, es)
        pooled = functools.reduce(jnp.add, [ar * (er / s) for ar, er in zip(avals, es)])
    else:
        base = j * ratio
        m = lax.fori_loop(1, ratio, lambda r, acc: jnp.maximum(acc, row(z_g, base + r, 0)), row(z_g, base, 0))

        def accumulate(r, carry):
            s, acc = carry
            e = jnp.exp(row(z_g, base + r, 0) - m)
            return s + e, acc + row(a_g, base + r, 0) * e

        zero = cast(jnp.zeros((d,), f32))
        s, acc = lax.fori_loop(0, ratio, accumulate, (zero, zero))
        pooled = acc / s

    x = pooled.astype(o_g.dtype).astype(f32)
    y = x * lax.rsqrt(jnp.sum(x * x) / d + eps)
    w = cast(w_g[...]).astype(f32)
    o_g[b, j, :] = (w * y).astype(o_g.dtype)


def compress_mgpu(a, z, norm_weight, cos, sin, *, ratio, eps, prev_a=None, prev_z=None, out_dtype=jnp.float32,
                  interpret=None):
    """Same contract as `compress_ref`: the Mosaic GPU kernel for pooling and norm (d a multiple of
    128; the reference otherwise), then RoPE in plain JAX. interpret: None, or a GPU-interpret
    params object (`InterpretGPUParams`: runs the kernel on CPU)."""
    bsz, length, c = a.shape
    n = length // ratio
    overlap = ratio == 4
    d = c // 2 if overlap else c
    if not supported(d):  # the dispatcher traces this branch on every platform: never raise
        return compress_ref(a, z, norm_weight, cos, sin, ratio=ratio, eps=eps, prev_a=prev_a, prev_z=prev_z,
                            out_dtype=out_dtype)
    if n == 0:
        return jnp.zeros((bsz, 0, d), out_dtype)
    has_prev = overlap and prev_a is not None
    operands = [a[:, : n * ratio].astype(jnp.float32), z[:, : n * ratio].astype(jnp.float32), norm_weight]
    if has_prev:
        operands += [prev_a.astype(jnp.float32), prev_z.astype(jnp.float32)]
    kernel = functools.partial(_kernel, ratio=ratio, d=d, eps=float(eps), has_prev=has_prev,
                               interpret=interpret is not None)
    entry = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((bsz, n, d), out_dtype),
        grid=(bsz, n),
        grid_names=("b", "j"),
        interpret=interpret,
        kernel_name="dsv4_compress",
    )(*operands)
    return apply_rope(entry, cos, sin)
