"""`grouped_matmul_gpu` and `grouped_swiglu_gpu` (the Pallas-Triton kernels for Hopper): their
bodies run by the Pallas interpreter on CPU against the plain-JAX references (the fused one also
against the unfused kernel), the grid metadata, the declared costs, and the kernels compiled
ahead of time for an H100 (sm_90a, through XLA's Triton and ptxas; dsv4_jax.tools.aot, the `aot`
extra) at DeepSeek-V4-Flash's routed-expert shapes. A missing compiler fails (no skips).
Nothing here runs on a GPU.

Tolerances (`_check`, as tests/test_grouped_matmul.py): kernel and reference dequantize the same
way (value times scale in fp32, rounded once to x's dtype: bit-identical weights) and accumulate
in fp32, so they differ only in the order of the sums (BK-column pieces, FP4's even and odd
columns apart, against the ragged dot's order).
* fp32 x: max |kernel - ref| <= 1e-5 * max |ref|: a few hundred fp32 products summed in another
  order differ by a few ulps of the largest partial sums.
* bf16 x: max |kernel - ref| <= 2^-6 * max |ref| and under 1% of the elements differ: the fp32
  sums agree to ~1e-6, but a last-bit difference can flip the rounding to bf16 (one bf16 ulp,
  2^-7 relative at worst).
Rows past sum(group_sizes) must be exactly zero (the interpreter starts outputs as NaN, so a row
no program stores shows up).
The fused kernel (`grouped_swiglu_gpu`) runs the same K pieces in the same order as the unfused
one and rounds each product to x's dtype as it does: in the interpreter it equals two
`grouped_matmul_gpu` calls and the activation exactly (on a GPU, Triton's and XLA's sigmoid may
differ in the last bit). Against the plain-JAX reference (fp32): the products' tolerance above,
carried through the activation (`_swiglu_bound`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.tools import aot
from dsv4_jax.model.quantized import QuantizedWeight
from pallas_kernels import (block_diagonal_matmul, grouped_matmul, grouped_matmul_ref, grouped_swiglu,
                            grouped_swiglu_ref, swiglu)
from pallas_kernels import grouped_matmul_gpu as gmg
from test_grouped_matmul import _check, _rope, _stored_pair, _weight  # the TPU kernel's tests' operands, tolerances

BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct


def _run(x, w, sizes, layer=None):
    values, scale, fmt = (w.values, w.scale, w.fmt) if hasattr(w, "fmt") else (w, None, None)
    return gmg.grouped_matmul_gpu(x, values, jnp.asarray(sizes, jnp.int32), fmt=fmt, scale=scale, layer=layer,
                                  interpret=True)


# (format, x dtype, E, N, K, group sizes, M): N and K off the tiles (FP4: K / 2 bytes and K / 32
# scales off the pieces, the last scale group partial); a decode-like spread of 1-row groups;
# one group holding every row; groups over several row tiles (TM 16: 40 rows are three tiles)
# with empty groups between; rows past every group; no row chosen at all; shapes the tiles
# divide (the weight loads unmasked). "-large": groups of M / E >= 32 rows on average, the
# prefill tiles (TM 128, TN 256: 130 rows are two tiles; FP8's 256-row column tile spans three
# scale blocks, one partial).
MATCHES = {
    "fp4-decode-bf16": ("fp4", BF16, 16, 96, 300, [1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 1, 1], 9),
    "fp4-multitile-fp32": ("fp4", F32, 8, 200, 256, [40, 0, 3, 17, 0, 0, 0, 1], 64),
    "fp8-padded-fp32": ("fp8", F32, 4, 200, 300, [5, 0, 9, 3], 20),
    "fp8-one-group-bf16": ("fp8", BF16, 4, 130, 256, [0, 37, 0, 0], 37),
    "fp8-decode-whole-bf16": ("fp8", BF16, 8, 128, 256, [1, 0, 1, 1, 0, 1, 0, 1], 6),
    "bf16-padded": ("bf16", BF16, 3, 70, 130, [17, 1, 12], 33),
    "fp32-none-chosen": ("fp32", F32, 4, 70, 130, [0, 0, 0, 0], 5),
    "fp4-large-bf16": ("fp4", BF16, 4, 300, 200, [130, 0, 100, 50], 300),
    "fp4-large-whole-fp32": ("fp4", F32, 2, 256, 128, [200, 56], 256),
    "fp8-large-fp32": ("fp8", F32, 3, 300, 200, [40, 90, 150], 300),
    "bf16-large": ("bf16", BF16, 2, 260, 130, [70, 60], 130),
}


@pytest.mark.parametrize("case", list(MATCHES))
def test_grouped_matmul_gpu_matches_ref(case):
    fmt, dtype, e, n, k, sizes, m = MATCHES[case]
    assert (gmg.tiles(m, e).tm == 128) == ("-large" in case)
    w = _weight(fmt, (e,), n, k, seed=n + k)
    x = jnp.asarray(np.random.default_rng(m * k).standard_normal((m, k)), dtype)
    out = _run(x, w, sizes)
    assert out.dtype == dtype and out.shape == (m, n)
    _check(out, grouped_matmul_ref(x, w, jnp.asarray(sizes, jnp.int32)), sizes)


def test_grouped_matmul_gpu_routed_tokens():
    """Tokens routed to 3 experts each: the (token, slot) rows sorted by expert, multiplied and
    put back; each row must be its token times its own expert (a token's rows lie in several
    groups), against a float64 product of the dequantized experts."""
    t, top_k, e, n, k = 6, 3, 8, 100, 192
    rng = np.random.default_rng(3)
    experts = np.stack([rng.choice(e, top_k, replace=False) for _ in range(t)])
    x = jnp.asarray(rng.standard_normal((t, k)), F32)
    w = _weight("fp4", (e,), n, k, seed=4)
    order = np.argsort(experts.reshape(-1), kind="stable")
    sizes = np.bincount(experts.reshape(-1), minlength=e).astype(np.int32)
    y = np.zeros((t * top_k, n), np.float32)
    y[order] = np.asarray(_run(x[order // top_k], w, sizes))
    dense = np.asarray(w.dequantize(F32), np.float64)
    want = np.einsum("tk,tjnk->tjn", np.asarray(x, np.float64), dense[experts]).reshape(t * top_k, n)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt, dtype", [("fp4", BF16), ("fp8", F32)])
def test_grouped_matmul_gpu_layer_of_a_stack(fmt, dtype):
    """With `layer` traced (under jit) the kernel reads layer `layer` of the `[L, E, N, K]`
    stack: the reference on that layer's slice, and not another layer's."""
    w = _weight(fmt, (3, 4), 72, 160, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((20, 160)), dtype)
    sizes = np.array([7, 0, 9, 3], np.int32)
    run = jax.jit(lambda x, g, layer: gmg.grouped_matmul_gpu(x, w.values, g, fmt=fmt, scale=w.scale, layer=layer,
                                                             interpret=True))
    outs = {layer: run(x, jnp.asarray(sizes), jnp.int32(layer)) for layer in (0, 2)}
    for layer, out in outs.items():
        _check(out, grouped_matmul_ref(x, w, jnp.asarray(sizes), layer=layer), sizes)
    assert not np.allclose(np.asarray(outs[0], np.float32), np.asarray(outs[2], np.float32))


def _routing(m, sizes, seed):
    """Routing weights `[m]` in (0, 1], NaN past the groups (an exchange's unset rows: never read)."""
    w = np.random.default_rng(seed).uniform(0.05, 1.0, m).astype(np.float32)
    w[int(np.sum(sizes)):] = np.nan
    return jnp.asarray(w)


def _fused(x, w1, w3, sizes, hw, limit, layer=None):
    return gmg.grouped_swiglu_gpu(x, _stored_pair(w1), _stored_pair(w3), jnp.asarray(sizes, jnp.int32), hw,
                                  fmt=getattr(w1, "fmt", None), limit=limit, layer=layer, interpret=True)


FUSED = ["fp4-decode-bf16", "fp4-multitile-fp32", "fp8-padded-fp32", "fp8-one-group-bf16", "bf16-padded",
         "fp32-none-chosen", "fp4-large-bf16", "fp8-large-fp32"]


@pytest.mark.parametrize("limit", [0.0, 0.7])
@pytest.mark.parametrize("case", FUSED)
def test_grouped_swiglu_gpu_equals_the_unfused_kernel(case, limit, monkeypatch):
    """The fused kernel against `grouped_matmul_gpu` twice (on the fused one's K pieces: the
    same sums in the same order) and `swiglu` times the routing weights: equal, at decode and
    prefill tiles (TN halved from 128), with and without the clamp; rows past the groups zero
    although their routing weights are NaN."""
    fmt, dtype, e, n, k, sizes, m = MATCHES[case]
    fused_tiles, tiles = gmg.swiglu_tiles(m, e, fmt), gmg.tiles
    assert fused_tiles.tm == tiles(m, e, fmt).tm
    w1, w3 = _weight(fmt, (e,), n, k, seed=n + k), _weight(fmt, (e,), n, k, seed=n + k + 1)
    x = jnp.asarray(np.random.default_rng(m * k).standard_normal((m, k)), dtype)
    hw = _routing(m, sizes, m)
    out = _fused(x, w1, w3, sizes, hw, limit)
    monkeypatch.setattr(gmg, "tiles", lambda *a: tiles(*a)._replace(bk=fused_tiles.bk))
    h1, h3 = _run(x, w1, sizes), _run(x, w3, sizes)
    want = np.asarray((swiglu(h1, h3, limit) * hw[:, None]).astype(dtype), np.float32)
    got = np.asarray(out, np.float32)
    total = int(np.sum(sizes))
    assert out.dtype == dtype and out.shape == (m, n)
    assert np.array_equal(got[:total], want[:total]) and np.all(got[total:] == 0.0)


def _swiglu_bound(h1, h3, hw, limit, err):
    """|d out| per element when the products h1, h3 `[M, N]` (fp32) are off by at most err: the
    activation's slopes (silu' <= 1.1; d/dh3 = silu(min(h1, limit))) times the routing weights."""
    c3 = np.clip(h3, -limit, limit) if limit > 0 else h3
    c1 = np.minimum(h1, limit) if limit > 0 else h1
    e = np.exp(-np.abs(c1.astype(np.float64)))
    silu = c1 * np.where(c1 >= 0, 1 / (1 + e), e / (1 + e))
    return np.abs(hw)[:, None] * err * (1.1 * np.abs(c3) + np.abs(silu))


@pytest.mark.parametrize("case", ["fp4-multitile-fp32", "fp8-padded-fp32", "fp8-large-fp32"])
def test_grouped_swiglu_matches_ref(case):
    """`grouped_swiglu` with impl="pallas" (in the interpreter: the fused TPU kernel,
    `grouped_swiglu_tpu`) and the GPU kernel against `grouped_swiglu_ref` (fp32), within the products'
    tolerance carried through the activation; a layer of a stack read in place."""
    fmt, dtype, e, n, k, sizes, m = MATCHES[case]
    w1, w3 = _weight(fmt, (2, e), n, k, seed=k), _weight(fmt, (2, e), n, k, seed=k + 1)
    x = jnp.asarray(np.random.default_rng(n).standard_normal((m, k)), dtype)
    g, hw, layer = jnp.asarray(sizes, jnp.int32), _routing(m, sizes, k), jnp.int32(1)
    want = np.asarray(grouped_swiglu_ref(x, w1, w3, g, hw, limit=0.7, layer=layer))
    h1, h3 = (np.asarray(grouped_matmul_ref(x, w, g, layer=layer)) for w in (w1, w3))
    err = 1e-5 * max(np.abs(h1).max(), np.abs(h3).max())
    total = int(np.sum(sizes))
    bound = _swiglu_bound(h1, h3, np.nan_to_num(np.asarray(hw)), 0.7, err)[:total] + 1e-6 * np.abs(want).max()
    for got in (grouped_swiglu(x, w1, w3, g, hw, limit=0.7, layer=layer, impl="pallas"),
                _fused(x, w1, w3, sizes, hw, 0.7, layer=layer)):
        got = np.asarray(got)
        assert np.all(got[total:] == 0.0)
        assert np.all(np.abs(got - want)[:total] <= bound)
    assert np.abs(want[:total]).max() > 0.1


def test_grouped_swiglu_bad_input():
    """Weights that differ, or routing weights not one per row: a ValueError naming them."""
    w = _weight("fp4", (4,), 64, 128, seed=0)
    x, g = jnp.zeros((8, 128), BF16), jnp.asarray([2, 2, 2, 2], jnp.int32)
    with pytest.raises(ValueError, match="w1 .* and w3 .* must be alike"):
        grouped_swiglu(x, w, _weight("fp8", (4,), 64, 128, seed=0), g, jnp.ones(8), limit=0.0)
    with pytest.raises(ValueError, match=r"hw \(8, 1\) must be \[M\]"):
        grouped_swiglu(x, w, w, g, jnp.ones((8, 1)), limit=0.0)


# (format, x dtype, blocks E, N, K, M): decode rows (fewer than a tile), blocks of prefill rows
# (the large tiles: 300 rows are three tiles of a block), N and K off the tiles.
BLOCK_DIAGONAL = {
    "bf16-decode": ("bf16", BF16, 8, 96, 256, 3),
    "fp8-padded-fp32": ("fp8", F32, 3, 200, 300, 20),
    "fp4-large-bf16": ("fp4", BF16, 4, 130, 256, 300),
    "bf16-large": ("bf16", BF16, 2, 256, 512, 130),
}


@pytest.mark.parametrize("case", list(BLOCK_DIAGONAL))
def test_block_diagonal_matmul_gpu(case):
    """x `[M, E*K]` times E blocks: the kernel reading x's column blocks in place equals the
    grouped kernel on x's blocks laid out as groups of rows (exactly: the same products in the
    same order), and `block_diagonal_matmul` (which does that re-layout off CUDA) equals a
    float64 product per block within the grouped matmul's tolerance; a layer of a stack."""
    fmt, dtype, e, n, k, m = BLOCK_DIAGONAL[case]
    w = _weight(fmt, (2, e), n, k, seed=n + k)
    values, scale, qfmt = (w.values, w.scale, w.fmt) if hasattr(w, "fmt") else (w, None, None)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, e * k)), dtype)
    layer = jnp.int32(1)
    out = gmg.block_diagonal_matmul_gpu(x, values, fmt=qfmt, scale=scale, layer=layer, interpret=True)
    assert out.shape == (m, e * n) and out.dtype == dtype
    rows = jnp.swapaxes(x.reshape(m, e, k), 0, 1).reshape(e * m, k)
    grouped = gmg.grouped_matmul_gpu(rows, values, jnp.full((e,), m, jnp.int32), fmt=qfmt, scale=scale, layer=layer,
                                     interpret=True)
    want = jnp.swapaxes(grouped.reshape(e, m, n), 0, 1).reshape(m, e * n)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    dense = np.asarray(w[1].dequantize(dtype) if hasattr(w, "fmt") else w[1].astype(dtype), np.float64)
    exact = np.einsum("mgk,gnk->mgn", np.asarray(x, np.float64).reshape(m, e, k), dense).reshape(m, e * n)
    ref = block_diagonal_matmul(x, w, layer=layer, impl="ref")
    _check(ref, jnp.asarray(exact, dtype), [m * e])
    _check(out, jnp.asarray(exact, dtype), [m * e])


# (format, x dtype, blocks E, N, K, M, head_dim, RoPE dims): Flash's heads (512, RoPE 64: NoPE
# pieces of 64) at decode rows and at the large tiles; RoPE dims 16 (pieces of 16) and 32; FP8
# weights (RoPE dims within one scale block); and heads the kernel cannot rotate as it loads
# them (RoPE 8 dims: under one tensor-core piece; FP4), rotated by XLA first.
ROTATED = {
    "flash-heads-decode-bf16": ("bf16", BF16, 2, 96, 1024, 3, 512, 64),
    "flash-heads-large-bf16": ("bf16", BF16, 2, 128, 1024, 130, 512, 64),
    "rope16-fp32": ("fp32", F32, 3, 70, 192, 20, 96, 16),
    "fp8-rope32-bf16": ("fp8", BF16, 2, 200, 256, 9, 128, 32),
    "rope8-xla-bf16": ("bf16", BF16, 2, 64, 128, 5, 64, 8),
    "fp4-xla-bf16": ("fp4", BF16, 2, 64, 256, 5, 128, 64),
}


@pytest.mark.parametrize("case", list(ROTATED))
def test_block_diagonal_matmul_gpu_rotates_back(case):
    """With x_rope, x's heads (the attention's output at its queries' rotation) are rotated back
    as the kernel loads them, head by head (NoPE pieces, then the RoPE dims as one piece,
    `rope_fused`): against `block_diagonal_matmul(impl="ref")` (rotated by `apply_rope` in XLA)
    within the tolerances above, the rotation visibly applied; where the heads do not allow it,
    the same result with XLA's rotation first."""
    fmt, dtype, e, n, k, m, head_dim, rope = ROTATED[case]
    w = _weight(fmt, (2, e), n, k, seed=n + k)
    values, scale, qfmt = (w.values, w.scale, w.fmt) if hasattr(w, "fmt") else (w, None, None)
    assert (gmg.rope_fused(head_dim, rope // 2, qfmt) is None) == ("-xla-" in case)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, e * k)), dtype)
    x_rope = _rope(m, rope // 2, seed=k)
    layer = jnp.int32(1)
    out = gmg.block_diagonal_matmul_gpu(x, values, fmt=qfmt, scale=scale, layer=layer, x_rope=x_rope,
                                        head_dim=head_dim, interpret=True)
    ref = block_diagonal_matmul(x, w, layer=layer, x_rope=x_rope, head_dim=head_dim, impl="ref")
    assert out.shape == (m, e * n) and out.dtype == dtype
    _check(out, ref, [m * e])
    plain = block_diagonal_matmul(x, w, layer=layer, impl="ref")
    assert np.abs(np.asarray(ref, np.float32) - np.asarray(plain, np.float32)).max() > 1e-2


def test_block_diagonal_matmul_gpu_rope_tiles():
    """Flash's and Pro's heads (512 values, RoPE 64) are rotated as loaded in K pieces of 64; the
    large tiles then take TN 128 (the registers for the RoPE piece); not FP4, RoPE pieces under 16
    values or across an FP8 scale block, nor NoPE dims that are not whole RoPE pieces.""" 
    assert gmg.rope_fused(512, 32, None) == gmg.rope_fused(512, 32, "fp8") == 64
    assert gmg.rope_fused(96, 8, None) == 16
    assert gmg.rope_fused(64, 4, None) is None and gmg.rope_fused(512, 32, "fp4") is None
    assert gmg.rope_fused(512, 128, "fp8") is None and gmg.rope_fused(512, 128, None) == 64
    assert gmg.rope_fused(224, 32, None) is None  # 160 NoPE dims: not pieces of 64 RoPE dims
    assert gmg.rope_tiles(512 * 8, 8, None, 64) == gmg.LARGE._replace(tn=128)
    assert gmg.rope_tiles(8, 8, None, 64) == gmg.tiles(8, 8)._replace(bk=64)


def test_block_diagonal_matmul_bad_input():
    """x whose columns are not E blocks of the weight's K: a ValueError naming the shapes."""
    w = _weight("bf16", (4,), 64, 128, seed=0)
    with pytest.raises(ValueError, match=r"block_diagonal_matmul: x \(8, 500\) and a weight \[4, 64, 128\]"):
        block_diagonal_matmul(jnp.zeros((8, 500), BF16), w)


@pytest.mark.parametrize("seed", range(6))
def test_grouped_matmul_gpu_metadata(seed):
    """The steps: each group with rows gets ceil(size / TM) tiles, which cover its rows exactly
    (so its expert is read that many times, once when it fits in a tile) and no empty group
    gets one (its expert is never read); the zeroing steps cover the rows past every group; all
    within the static bound. Random sizes, some all in one group, some with none."""
    rng = np.random.default_rng(seed)
    m, e = int(rng.integers(1, 300)), int(rng.choice([1, 4, 256]))
    if seed == 0:
        sizes = np.zeros(e, np.int32)
    elif seed == 1:
        sizes = np.eye(e, dtype=np.int32)[e - 1] * m
    else:
        sizes = np.bincount(rng.integers(0, e, int(rng.integers(0, m + 1))), minlength=e).astype(np.int32)
    tm = gmg.row_tile(m, e)
    steps = gmg.max_steps(m, e, tm)
    start, end, group, live = map(np.asarray, gmg._metadata(jnp.asarray(sizes), m, tm, steps))
    n_real, n_live = live
    assert n_live <= steps
    ends = np.cumsum(sizes)
    covered = np.zeros(m, np.int32)
    for t in range(n_real):
        g = group[t]
        assert sizes[g] > 0 and end[t] == ends[g] and start[t] >= ends[g] - sizes[g]
        covered[start[t]:min(start[t] + tm, end[t])] += 1
    assert np.array_equal(np.bincount(group[:n_real], minlength=e), -(-sizes // tm))
    for t in range(n_real, n_live):
        assert start[t] >= ends[-1] and end[t] == m
        covered[start[t]:min(start[t] + tm, m)] += 1
    assert np.all(covered == 1)  # every row stored by exactly one step


# Flash's routed experts (256, hidden 4096, moe_intermediate 2048), FP4 and FP8: (format, M, N, K,
# E): decode (8 tokens x top-6 = 48 rows), a 512-token prefill chunk (3072 rows, TM 32), and 8
# such sequences' chunk on one of 8 GPUs, expert parallel (24576 rows over its 32 experts, ~768
# rows each: the large tiles).
FLASH = {
    "fp4-w1-decode": ("fp4", 48, 2048, 4096, 256),
    "fp8-w1-decode": ("fp8", 48, 2048, 4096, 256),
    "fp4-w2-prefill": ("fp4", 3072, 4096, 2048, 256),
    "fp4-w1-prefill": ("fp4", 3072, 2048, 4096, 256),
    "fp4-w1-prefill-ep": ("fp4", 24576, 2048, 4096, 32),
    "fp4-w2-prefill-ep": ("fp4", 24576, 4096, 2048, 32),
    "fp8-w1-prefill-ep": ("fp8", 24576, 2048, 4096, 32),
}


def _stored(fmt, lead, n, k):
    if fmt == "fp8":
        return [S(lead + (n, k), jnp.float8_e4m3fn), S(lead + (-(-n // 128), -(-k // 128)), F32)]
    return [S(lead + (n, k // 2), jnp.uint8), S(lead + (n, -(-k // 32)), jnp.uint8)]


def _declared(fn, *args):
    """The pl.CostEstimate declared on the kernel's pallas_call (the Triton lowering drops it,
    so it is read from the traced program)."""
    eqns = [q for q in jax.make_jaxpr(fn)(*args).eqns if q.primitive.name == "pallas_call"]
    assert len(eqns) == 1
    return eqns[0].params["cost_estimate"]


@pytest.mark.parametrize("case", [c for c in FLASH if c != "fp4-w2-prefill-ep"])
def test_grouped_matmul_gpu_declared_cost(case):
    """Declared bytes (HBM) >= what the kernel must read and write at least: the stored values
    and scales of min(E, M) chosen experts, x and the output; and exactly that when an expert
    fits a quarter of L2 (a group's steps, launched together, re-read its weight from L2; the
    column tiles of a step its x rows), as Flash's do. An expert too large for that is counted
    once per computing step (the grid bound). Flops: TM rows on every computing step."""
    fmt, m, n, k, E = FLASH[case]
    stored = _stored(fmt, (E,), n, k)
    per_expert = sum(a.size * a.dtype.itemsize for a in stored) // E
    assert per_expert == gmg.stored_bytes_per_expert(n, k, fmt, 1)
    cost = _declared(lambda x, g, v, s: gmg.grouped_matmul_gpu(x, v, g, fmt=fmt, scale=s),
                     S((m, k), BF16), S((E,), jnp.int32), *stored)
    io = 2 * (m * k + m * n)
    assert 4 * per_expert <= gmg.L2_BYTES
    assert cost.bytes_accessed == min(E, m) * per_expert + io
    tm = gmg.tiles(m, E, fmt).tm
    assert cost.flops == 2 * (gmg.max_steps(m, E, tm) - 1) * tm * n * k
    big_n, big_k = 8192, 8192  # an FP8 expert of 64 MiB
    big = gmg.cost_estimate(m, big_n, big_k, E, "fp8", 2, 1)
    steps = gmg.max_steps(m, E, gmg.tiles(m, E, "fp8").tm) - 1
    assert big.bytes_accessed == steps * gmg.stored_bytes_per_expert(big_n, big_k, "fp8", 1) + 2 * (m * big_k + m * big_n)


@pytest.mark.parametrize("case", ["fp4-w1-decode", "fp4-w1-prefill-ep", "fp8-w1-prefill-ep"])
def test_grouped_swiglu_gpu_declared_cost(case):
    """The fused kernel declares both weights' stored bytes of min(E, M) chosen experts, x once,
    the routing weights and its one output; twice the flops of one product's kernel."""
    fmt, m, n, k, E = FLASH[case]
    stored = _stored(fmt, (E,), n, k)
    per_expert = gmg.stored_bytes_per_expert(n, k, fmt, 1)

    def fused(x, g, hw, v1, s1, v3, s3):
        return gmg.grouped_swiglu_gpu(x, (v1, s1), (v3, s3), g, hw, fmt=fmt, limit=10.0)

    cost = _declared(fused, S((m, k), BF16), S((E,), jnp.int32), S((m,), F32), *stored, *stored)
    assert cost.bytes_accessed == 2 * min(E, m) * per_expert + 2 * (m * k + m * n) + 4 * m
    assert cost.flops == 2 * gmg.cost_estimate(m, n, k, E, fmt, 2, 1).flops


def _touching(text: str, shape: str) -> list[str]:
    """The instructions but parameters and kernel calls whose types hold an array of `shape`
    (a copy, a slice of the layer or a dequantized stack would)."""
    instructions = [line for line in text.splitlines() if re.match(r"\s+(ROOT )?%\S+ = ", line)]
    return [line for line in instructions
            if re.search(rf"[\[,]{shape}\]", line) and " parameter(" not in line and "custom-call(" not in line]


@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("m", [8, 512], ids=["decode", "prefill"])
def test_block_diagonal_matmul_compiles_for_h100(m, rotated):
    """Flash's grouped output projection (8 groups of 8 heads x 512 times wo_a's bf16 blocks
    `[8, 1024, 4096]`, one layer of a stack; "rotated": x's heads rotated back at the rows'
    angles, as the model calls it) through `block_diagonal_matmul(impl="pallas")`: the grouped
    kernel alone, and no instruction holds x (rotated, or its blocks as groups of rows
    `[8, M, 4096]`), the output's blocks `[8, M, 1024]` or the weight."""
    e, n, k = 8, 1024, 4096
    stack = S((3, e, n, k), BF16)
    rope = (S((m, 32), F32),) * 2 if rotated else ()

    def fn(x, w, layer, *cs):
        return block_diagonal_matmul(x, w, layer=layer, x_rope=cs or None, head_dim=512, impl="pallas")

    result = aot.compile_for("h100x1", jax.jit(fn), S((m, e * k), BF16), stack, S((), jnp.int32), *rope)
    assert aot.kernel_calls(result.compiled, "cuda") == [gmg.NAME]
    text = result.compiled.as_text()
    for shape in (f"{m},{e * k}", f"{m},{e},{k}", f"{e},{m},{k}", f"{e * m},{k}", f"{e},{m},{n}", f"{e * m},{n}",
                  f"{e},{n},{k}"):
        assert not _touching(text, shape), shape


@pytest.mark.parametrize("case", ["fp4-w1-decode", "fp4-w2-prefill", "fp8-w1-decode-layer"])
def test_grouped_matmul_gpu_compiles_for_h100(case):
    """Through `grouped_matmul(impl="pallas")` (the dispatcher's CUDA branch), the compiled
    program holds the Triton kernel and nothing else touches the weight: no op but the kernel
    has the values' shape (a copy, a slice of the layer or a dequantized stack would)."""
    layered = case.endswith("-layer")
    fmt, m, n, k, E = FLASH[case.removesuffix("-layer")]
    lead = (2, E) if layered else (E,)
    stored = _stored(fmt, lead, n, k)

    def fn(x, g, v, s, *layer):
        return grouped_matmul(x, QuantizedWeight(v, s, fmt=fmt), g, layer=layer[0] if layer else None,
                              impl="pallas")

    args = (S((m, k), BF16), S((E,), jnp.int32), *stored) + ((S((), jnp.int32),) if layered else ())
    result = aot.compile_for("h100x1", jax.jit(fn), *args)
    assert aot.kernel_calls(result.compiled, "cuda") == [gmg.NAME]  # the one kernel call, and Triton's:
    assert f'custom_call_target="{aot.TRITON_CALL}"' in result.compiled.as_text()
    shape = ",".join(map(str, stored[0].shape[-3:]))  # the stack, or one layer of it
    touching = _touching(result.compiled.as_text(), shape)
    assert not touching, touching


@pytest.mark.parametrize("case", ["fp4-w1-decode", "fp8-w1-prefill-ep-layer"])
def test_grouped_swiglu_gpu_compiles_for_h100(case):
    """Through `grouped_swiglu(impl="pallas")`, the compiled program holds the fused Triton kernel
    alone, and nothing else touches either weight."""
    layered = case.endswith("-layer")
    fmt, m, n, k, E = FLASH[case.removesuffix("-layer")]
    lead = (2, E) if layered else (E,)
    stored = _stored(fmt, lead, n, k)

    def fn(x, g, hw, v1, s1, v3, s3, *layer):
        w1, w3 = QuantizedWeight(v1, s1, fmt=fmt), QuantizedWeight(v3, s3, fmt=fmt)
        return grouped_swiglu(x, w1, w3, g, hw, limit=10.0, layer=layer[0] if layer else None, impl="pallas")

    args = (S((m, k), BF16), S((E,), jnp.int32), S((m,), F32), *stored, *stored)
    result = aot.compile_for("h100x1", jax.jit(fn), *args + ((S((), jnp.int32),) if layered else ()))
    assert aot.kernel_calls(result.compiled, "cuda") == [gmg.SWIGLU_NAME]
    shape = ",".join(map(str, stored[0].shape[-3:]))
    assert not _touching(result.compiled.as_text(), shape)


@pytest.mark.parametrize("case", ["fp4-w1-decode", "fp4-w1-prefill", "fp4-w2-prefill-ep", "fp8-w1-prefill-ep",
                                  "swiglu-fp4-w1-decode", "swiglu-fp4-w1-prefill-ep", "swiglu-fp8-w1-prefill-ep",
                                  "rotated-decode", "rotated-prefill"])
def test_grouped_matmul_gpu_registers(case, tmp_path):
    """The kernels' PTX (XLA's dump of the h100x1 compile) through ptxas -v for sm_90a (the
    CUDA 12.9 one XLA uses, first on PATH once dsv4_jax.tools.aot is imported): no spills and no
    stack at any tile choice (the 128 x 256 prefill tiles hold a 128-register accumulator a
    thread; the fused kernel's two 128 x 128 ones as many), and its shared memory (XLA's thunk
    sequence) within Hopper's 227 KB a block."""
    fused = case.startswith("swiglu-")
    if case.startswith("rotated-"):  # Flash's grouped output projection, its heads rotated back as loaded
        m = 8 if case == "rotated-decode" else 512
        name, tl = gmg.NAME, gmg.rope_tiles(8 * m, 8, None, gmg.rope_fused(512, 32, None))
        def fn(x, v, cos, sin):
            return gmg.block_diagonal_matmul_gpu(x, v, x_rope=(cos, sin), head_dim=512)
        args = (S((m, 8 * 4096), BF16), S((8, 1024, 4096), BF16), S((m, 32), F32), S((m, 32), F32))
    elif fused:
        fmt, m, n, k, e = FLASH[case.removeprefix("swiglu-")]
        stored = _stored(fmt, (e,), n, k)
        name, tl = gmg.SWIGLU_NAME, gmg.swiglu_tiles(m, e, fmt)
        def fn(x, g, hw, v1, s1, v3, s3):
            return gmg.grouped_swiglu_gpu(x, (v1, s1), (v3, s3), g, hw, fmt=fmt, limit=10.0)
        args = (S((m, k), BF16), S((e,), jnp.int32), S((m,), F32), *stored, *stored)
    else:
        fmt, m, n, k, e = FLASH[case]
        stored = _stored(fmt, (e,), n, k)
        name, tl = gmg.NAME, gmg.tiles(m, e, fmt)
        def fn(x, g, v, s):
            return gmg.grouped_matmul_gpu(x, v, g, fmt=fmt, scale=s)
        args = (S((m, k), BF16), S((e,), jnp.int32), *stored)
    aot.compile_for("h100x1", jax.jit(fn), *args,
                    compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "NONE"})
    ptx = [p for p in tmp_path.rglob("*.ptx") if f".entry {name}" in p.read_text()]
    assert len(ptx) == 1, ptx
    report = subprocess.run([shutil.which("ptxas"), "-arch=sm_90a", "-v", str(ptx[0]), "-o", os.devnull],
                            capture_output=True, text=True, check=True).stderr
    info = report[report.index(f"Compiling entry function '{name}'"):]
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", info), info
    assert int(re.search(r"Used (\d+) registers", info).group(1)) <= 255, info
    thunks = [line for p in tmp_path.glob("*thunk_sequence.txt") for line in p.read_text().splitlines()
              if name in line]
    smem = int(re.search(r"shared_memory: (\d+) bytes", thunks[0]).group(1))
    assert f"threads: [{32 * tl.num_warps}, 1, 1]" in thunks[0] and 0 < smem <= 227 * 1024, thunks[0]
