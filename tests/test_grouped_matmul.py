"""`grouped_matmul`: the TPU kernel body (run by the Pallas interpreter on CPU) against the
plain-JAX reference on random inputs, and the kernel compiled ahead of time for TPU v5p, v6e and
v7x at DeepSeek-V4-Flash's routed-expert shapes (dsv4_jax.tools.aot; the `aot` extra).

Tolerances (`_check`): both sides dequantize the same way (value times scale in fp32, rounded
once to x's dtype) and accumulate in fp32; they differ only in the order of the sums (the
ragged dot's against the MXU tile order).
* fp32 x: max |kernel - ref| <= 1e-5 * max |ref|: K <= 4096 fp32 products summed in another
  order differ by a few ulps of the largest partial sums.
* bf16 x: max |kernel - ref| <= 2^-6 * max |ref|, and fewer than 1% of the elements differ: the
  fp32 sums agree to ~1e-6, but the result is rounded to bf16, and a last-bit difference can
  flip that rounding (one bf16 ulp, 2^-7 relative at worst).
Rows past sum(group_sizes) must be exactly zero.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from dsv4_jax.tools import aot
from dsv4_jax.model.quantized import QuantizedWeight
from pallas_kernels import grouped_matmul, grouped_matmul_ref, swiglu
from dsv4_jax.tools import kernel_report as report
from pallas_kernels import grouped_matmul_tpu as gmt

BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct


def _check(out, ref, sizes):
    out = np.asarray(out.astype(F32))
    ref_ = np.asarray(ref.astype(F32))
    assert out.shape == ref_.shape and out.dtype == ref_.dtype
    assert np.all(out[int(np.sum(sizes)):] == 0.0)
    scale = max(np.abs(ref_).max(), 1e-30)
    err = np.abs(out - ref_).max()
    if ref.dtype == F32:
        assert err <= 1e-5 * scale, (err, scale)
    else:
        assert err <= 2.0 ** -6 * scale, (err, scale)
        assert np.mean(out != ref_) < 0.01


def _weight(fmt, lead, n, k, seed, float_scales=False):
    """A random expert stack `lead + [n, k]`: "fp8" (e4m3 values over their whole range and
    power-of-two block scales, as V4 stores them, or arbitrary positive float scales), "fp4"
    (every code byte, E8M0 scales near 1), or a plain "bf16" / "fp32" array."""
    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    if fmt == "fp8":
        values = (rng.standard_normal(lead + (n, k)) * 2.0 ** rng.integers(-9, 8, lead + (n, k))).clip(-448, 448)
        blocks = lead + (-(-n // 128), -(-k // 128))
        scale = rng.uniform(0.001, 0.1, blocks) if float_scales else 2.0 ** rng.integers(-12, 2, blocks)
        return QuantizedWeight(jnp.asarray(values, jnp.float8_e4m3fn), jnp.asarray(scale, F32), fmt="fp8")
    if fmt == "fp4":
        return QuantizedWeight(jnp.asarray(rng.integers(0, 256, lead + (n, k // 2)), jnp.uint8),
                               jnp.asarray(rng.integers(118, 136, lead + (n, -(-k // 32))), jnp.uint8), fmt="fp4")
    return jnp.asarray(rng.standard_normal(lead + (n, k)), BF16 if fmt == "bf16" else F32)


def _sizes(m, e, kind, seed):
    """group_sizes `[e]`: "spread" (random, some experts empty, sum m), "padded" (the same over
    m - 5 rows: the last rows belong to no group), "one" (every row in one expert)."""
    rng = np.random.default_rng(seed)
    if kind == "one":
        return np.eye(e, dtype=np.int32)[e // 2] * m
    rows = m - 5 if kind == "padded" and m > 5 else m
    used = rng.random(e) < 0.6
    used[rng.integers(e)] = True
    choice = rng.choice(np.flatnonzero(used), rows)
    return np.bincount(choice, minlength=e).astype(np.int32)


# (M, format, x dtype, E, N, K, group sizes): M from decode (1, 3, 8 rows, fewer than E) to a
# prefill chunk (512); N and K off the 128 lanes; FP4 with K / 32 a multiple of 128 (scales read
# as stored, `[E, N, G]`) and not (read transposed, `[E, G, N]`); float FP8 scales in
# test_grouped_matmul_dequantizes_exactly.
MATCHES = [
    (1, "fp8", BF16, 8, 200, 300, "spread"),
    (3, "fp4", F32, 8, 200, 300, "padded"),
    (8, "fp4", BF16, 4, 128, 4096, "spread"),
    (8, "fp32", F32, 16, 300, 200, "one"),
    (64, "bf16", F32, 6, 256, 128, "padded"),
    (512, "fp8", BF16, 8, 384, 256, "spread"),
    (512, "fp4", BF16, 4, 256, 192, "padded"),
]


@pytest.mark.parametrize("m, fmt, dtype, e, n, k, kind", MATCHES)
def test_grouped_matmul_matches_ref(m, fmt, dtype, e, n, k, kind):
    w = _weight(fmt.split("-")[0], (e,), n, k, seed=m + n + k, float_scales=fmt.endswith("float"))
    x = jnp.asarray(np.random.default_rng(m * k).standard_normal((m, k)), dtype)
    sizes = _sizes(m, e, kind, seed=m + e)
    g = jnp.asarray(sizes)
    out = grouped_matmul(x, w, g, impl="pallas")
    assert out.dtype == dtype and out.shape == (m, n)
    _check(out, grouped_matmul_ref(x, w, g), sizes)


@pytest.mark.parametrize("sizes", [
    [0, 70, 0, 0, 0, 0],  # one group holds every row
    [5, 0, 20, 1, 0, 30],  # groups straddle tiles; rows 56..69 (a whole tile of them) in no group
    [16, 16, 0, 16, 16, 6],  # groups on tile edges
    [0, 0, 0, 0, 0, 0],  # no row chosen: all zeros
])
def test_grouped_matmul_group_layouts(sizes):
    """Small tiles (TM 16, TN 128: 5 row tiles, 3 column tiles) so that tiles straddle groups,
    a tile lies past every group, and empty groups sit between and around the others."""
    w = _weight("fp8", (6,), 300, 200, seed=1)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((70, 200)), F32)
    g = jnp.asarray(sizes, jnp.int32)
    out = gmt.grouped_matmul_tpu(x, w.values, g, fmt="fp8", scale=w.scale, interpret=True, block_shape=(16, 128))
    _check(out, grouped_matmul_ref(x, w, g), sizes)


def test_grouped_matmul_routed_tokens():
    """Tokens routed to 3 experts each: the (token, slot) rows sorted by expert, multiplied,
    and put back; each row must be its token times its own expert (a token's rows lie in
    several groups, at once and in tiles shared with other tokens)."""
    t, top_k, e, n, k = 6, 3, 8, 200, 256
    rng = np.random.default_rng(3)
    experts = np.stack([rng.choice(e, top_k, replace=False) for _ in range(t)])
    x = jnp.asarray(rng.standard_normal((t, k)), F32)
    w = _weight("fp4", (e,), n, k, seed=4)
    order = np.argsort(experts.reshape(-1), kind="stable")
    sizes = np.bincount(experts.reshape(-1), minlength=e).astype(np.int32)
    rows = gmt.grouped_matmul_tpu(x[order // top_k], w.values, jnp.asarray(sizes), fmt="fp4", scale=w.scale,
                                  interpret=True, block_shape=(16, 128))
    y = np.zeros((t * top_k, n), np.float32)
    y[order] = np.asarray(rows)
    dense = np.asarray(w.dequantize(F32), np.float64)
    want = np.einsum("tk,tjnk->tjn", np.asarray(x, np.float64), dense[experts]).reshape(t * top_k, n)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt, dtype", [("fp4", F32), ("bf16", BF16)])
def test_grouped_matmul_layer_of_a_stack(fmt, dtype):
    """With `layer` (traced, under jit) the kernel reads layer `layer` of the `[L, E, N, K]`
    stack: the same as the reference on that layer's slice, and not another layer's."""
    w = _weight(fmt, (3, 4), 200, 256, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((20, 256)), dtype)
    sizes = np.array([7, 0, 9, 3], np.int32)
    run = jax.jit(lambda x, g, layer: grouped_matmul(x, w, g, layer=layer, impl="pallas"))
    outs = [run(x, jnp.asarray(sizes), jnp.int32(layer)) for layer in (0, 2)]
    for layer, out in zip((0, 2), outs):
        _check(out, grouped_matmul_ref(x, w[layer], jnp.asarray(sizes)), sizes)
    assert not np.allclose(np.asarray(outs[0], F32), np.asarray(outs[1], F32))


@pytest.mark.parametrize("fmt, dtype", [("fp8", F32), ("fp4", BF16)])
def test_grouped_matmul_dequantizes_exactly(fmt, dtype):
    """x = the identity, its rows split over experts 0 and 2: every output is one product with
    1.0, so row i must be column i of its expert's dequantized weight bit for bit (FP4: the
    nibble order and every per-32 scale; FP8: the block scales, float ones included)."""
    k, n = 256, 200
    w = _weight(fmt, (3,), n, k, seed=7, float_scales=True)
    sizes = np.array([100, 0, 156], np.int32)
    out = gmt.grouped_matmul_tpu(jnp.eye(k, dtype=dtype), w.values, jnp.asarray(sizes), fmt=fmt, scale=w.scale,
                                 interpret=True, block_shape=(64, 128))
    dense = np.asarray(w.dequantize(dtype).astype(F32))
    want = np.concatenate([dense[0].T[:100], dense[2].T[100:]])
    np.testing.assert_array_equal(np.asarray(out.astype(F32)), want)


def test_grouped_matmul_metadata():
    """Steps go only to groups with rows, in order over their row tiles (a straddled tile
    once per group); the zeroing steps cover the tiles past every group; the padding steps
    repeat the last group, x tile and output tile, so the pipeline fetches nothing for them."""
    sizes = jnp.asarray([5, 0, 20, 1, 0, 30, 0], jnp.int32)  # 56 rows of 80: tiles of 16
    steps = gmt.max_steps(5, 80, 7)
    group, out_tile, x_tile, offsets, live = (np.asarray(a) for a in gmt._metadata(sizes, 5, 16, steps))
    assert steps == 5 + 7 - 1 and list(live) == [7, 8]
    assert list(group[:7]) == [0, 2, 2, 3, 5, 5, 5] and list(out_tile[:7]) == [0, 0, 1, 1, 1, 2, 3]
    assert list(x_tile[:7]) == list(out_tile[:7]) and list(offsets) == [0, 5, 5, 25, 26, 26, 56, 56]
    assert out_tile[7] == 4 and group[7] == 5 and x_tile[7] == 3  # the zeroed tile: no new weight, no x
    assert all(group[8:] == 5) and all(out_tile[8:] == 4) and all(x_tile[8:] == 3)


def test_grouped_matmul_tiles():
    """Decode (8 rows of 256 experts: TM 16, 8 steps, not 256; TN 512) and a 512-token prefill
    chunk of top-6 rows (12 rows per expert: TM 16) at Flash's w1 shape; a prefill (more rows
    than one tile) takes two column tiles (x is read once per column tile), also under expert
    parallelism on 8 devices (24,576 rows over 32 experts, w1 and w2), within the VMEM budget."""
    assert gmt.tiles(8, 2048, 4096, 256, "fp8", 2, 1) == (16, 512)
    assert gmt.max_steps(1, 8, 256) == 8
    assert gmt.tiles(3072, 2048, 4096, 256, "fp4", 2, 1) == (16, 1024)
    assert gmt.max_steps(3072 // 16, 3072, 256) == 192 + 255
    assert gmt.tiles(512, 256, 256, 4, None, 4, 4) == (128, 256)
    for n, k in ((2048, 4096), (4096, 2048)):
        for fmt, itemsize in (("fp4", 1), ("fp8", 1)):
            tm, tn = gmt.tiles(24576, n, k, 32, fmt, 2, itemsize)
            assert tn == n // 2 and tm >= gmt.WIDE_MIN_TM
            assert gmt.vmem_bytes(tm, tn, n, k, 32, fmt, 2, itemsize) <= gmt.VMEM_BUDGET


def test_grouped_matmul_impls_and_errors():
    w = _weight("fp8", (4,), 200, 300, seed=8)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((10, 300)), F32)
    g = jnp.asarray([3, 0, 4, 2], jnp.int32)
    ref = grouped_matmul_ref(x, w, g)
    np.testing.assert_array_equal(np.asarray(grouped_matmul(x, w, g, impl="ref")), np.asarray(ref))
    if jax.default_backend() == "cpu":  # "auto" is the reference where no kernel runs
        np.testing.assert_array_equal(np.asarray(grouped_matmul(x, w, g)), np.asarray(ref))
    with pytest.raises(ValueError):
        grouped_matmul(x, w, g, impl="triton")
    with pytest.raises(ValueError, match=r"x \(10, 300\), a weight \[4, 200, 300\] and group_sizes \(3,\)"):
        grouped_matmul(x, w, g[:3])
    with pytest.raises(ValueError, match="needs x"):
        grouped_matmul(x, w, g, layer=0)
    assert {"grouped_matmul", "grouped_matmul_ref"} <= set(pallas_kernels.__all__)


# ----------------------------------------------------------------------------- compiled for TPU

TPU_TARGETS = [t for t in ("v5p-8", "v6e-8", "tpu7x-8") if aot.target(t).platform == "tpu"]
HLO_DTYPES = {jnp.dtype(jnp.float8_e4m3fn): "f8e4m3fn", jnp.dtype(jnp.uint8): "u8", jnp.dtype(F32): "f32",
              jnp.dtype(BF16): "bf16"}

# (format, M, E, N, K, layers): V4-Flash's routed experts (256 of them; w1/w3 [2048, 4096], w2
# [4096, 2048]): decode (8 rows, e.g. one token's 6 plus 2 more; fewer than E) and a 512-token
# prefill chunk of top-6 rows (3072), stacked over layers (the layer read in place) or not.
COMPILED = {
    "fp8-w1-decode-layers": ("fp8", 8, 256, 2048, 4096, 2),
    "fp4-w1-decode-layers": ("fp4", 8, 256, 2048, 4096, 2),
    "fp4-w2-prefill-layers": ("fp4", 3072, 256, 4096, 2048, 2),
    "bf16-w1-prefill": ("bf16", 3072, 256, 2048, 4096, None),
}


def _stored(fmt, lead, n, k):
    """The stored arrays of an expert stack, as abstract values."""
    if fmt == "fp8":
        return [S(lead + (n, k), jnp.float8_e4m3fn), S(lead + (-(-n // 128), -(-k // 128)), F32)]
    if fmt == "fp4":
        return [S(lead + (n, k // 2), jnp.uint8), S(lead + (n, -(-k // 32)), jnp.uint8)]
    return [S(lead + (n, k), BF16)]


def _stack_ops(hlo: str, array) -> list[str]:
    """The instructions of the compiled program, but the parameter and the kernel itself, that
    produce an array of the stack's shape in another layout, or by any op but a move between
    memory spaces (XLA may put a small operand in VMEM before the kernel)."""
    shape = f"{HLO_DTYPES[jnp.dtype(array.dtype)]}[{','.join(map(str, array.shape))}]"
    param = re.search(re.escape(shape) + r"\{([^}]*)\}[^\n]* parameter\(", hlo)
    layout = re.sub(r"S\(\d+\)", "", param.group(1))
    bad = []
    for line in hlo.splitlines():
        if (shape not in line or not re.match(r"\s*(ROOT )?%\S+ = ", line) or " parameter(" in line
                or "tpu_custom_call" in line):
            continue
        layouts = {re.sub(r"S\(\d+\)", "", m) for m in re.findall(re.escape(shape) + r"\{([^}]*)\}", line)}
        if layouts != {layout} or not re.search(r" (copy-start|copy-done)\(", line):
            bad.append(line.strip()[:200])
    return bad


@pytest.mark.parametrize("case", list(COMPILED))
@pytest.mark.parametrize("target", TPU_TARGETS)
def test_grouped_matmul_compiles_and_reads_chosen_experts_once(target, case):
    """The kernel is in the compiled program; its declared cost (what dsv4-plan counts) and the
    program's are at least the stored bytes (values and scales) of the experts the rows may
    choose (min(E, M) of them), and the declared one at most 10% more than those, x and the
    output (x is read once per column tile; FP8 reads its layer's scales whole); and no op but
    the kernel copies or re-lays out a weight stack (the layer is not sliced out, and the
    scales are taken in the layout XLA stores them in)."""
    fmt, m, e, n, k, layers = COMPILED[case]
    lead = (layers, e) if layers else (e,)
    weights = _stored(fmt, lead, n, k)
    args = [S((m, k), BF16), S((e,), jnp.int32), *weights] + ([S((), jnp.int32)] if layers else [])

    def fn(x, g, *rest):
        w, layer = (rest[:-1], rest[-1]) if layers else (rest, None)
        return gmt.grouped_matmul_tpu(x, w[0], g, fmt=None if fmt == "bf16" else fmt,
                                      scale=w[1] if len(w) > 1 else None, layer=layer)

    result = aot.compile_for(target, jax.jit(fn), *args)
    assert aot.kernel_calls(result.compiled, "tpu") == ["dsv4_grouped_matmul"]
    per_expert = sum(a.size * a.dtype.itemsize for a in weights) // (layers or 1) // e
    chosen = min(e, m) * per_expert
    declared = report._tpu_facts(result.compiled)["declared_cost"]["bytes_accessed"]
    assert result.cost["bytes accessed"] >= declared >= chosen
    assert declared <= 1.1 * (chosen + 2 * m * (k + n))
    hlo = result.compiled.as_text()
    assert [op for a in weights for op in _stack_ops(hlo, a)] == []


# ----------------------------------------------------------------------------- block-diagonal form

def _rope(m, half, seed):
    """cos, sin fp32 `[m, half]` of random angles (a row's RoPE at its position)."""
    angle = np.random.default_rng(seed).uniform(-np.pi, np.pi, (m, half))
    return jnp.asarray(np.cos(angle), F32), jnp.asarray(np.sin(angle), F32)


# (format, x dtype, blocks E, N, K, M, head_dim, RoPE dims): decode rows, a prefill chunk's 512
# (tiles of 512 rows, the whole width N in one column tile), rows off the 16-row tile; RoPE dims
# under and over a lane's 128 within their head (the rotated lanes are the head's last 128).
BLOCK_DIAGONAL = {
    "bf16-decode": ("bf16", BF16, 4, 128, 256, 3, 128, 64),
    "fp32-prefill": ("fp32", F32, 2, 256, 512, 512, 256, 32),
    "fp8-rows40": ("fp8", BF16, 2, 384, 256, 40, 256, 128),
    "bf16-head512": ("bf16", BF16, 2, 128, 1024, 24, 512, 64),
}


@pytest.mark.parametrize("case", list(BLOCK_DIAGONAL))
def test_block_diagonal_matmul_tpu(case):
    """x `[M, E*K]` times E blocks by the TPU kernel's block-diagonal form (each group's rows read
    in place in x's column block), with and without x_rope (x's heads rotated back in VMEM):
    against `block_diagonal_matmul(impl="ref")` (x rotated back by `apply_rope` in XLA, laid out
    as groups of rows, the ragged product) within the tolerances above, and equal to what the
    dispatcher runs for "pallas" off TPU; and the rotation changes the result (so it is applied)."""
    fmt, dtype, e, n, k, m, head_dim, rope = BLOCK_DIAGONAL[case]
    w = _weight(fmt, (2, e), n, k, seed=n + k)
    values, scale, qfmt = (w.values, w.scale, w.fmt) if hasattr(w, "fmt") else (w, None, None)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, e * k)), dtype)
    layer = jnp.int32(1)
    x_rope = _rope(m, rope // 2, seed=m + rope)
    for cs in (None, x_rope):
        out = gmt.block_diagonal_matmul_tpu(x, values, fmt=qfmt, scale=scale, layer=layer, x_rope=cs,
                                            head_dim=head_dim, interpret=True)
        ref = pallas_kernels.block_diagonal_matmul(x, w, layer=layer, x_rope=cs, head_dim=head_dim, impl="ref")
        assert out.shape == (m, e * n) and out.dtype == dtype
        _check(out, ref, [m])
        # the dispatcher's "pallas" off TPU: this kernel, interpreted
        dispatched = pallas_kernels.block_diagonal_matmul(x, w, layer=layer, x_rope=cs, head_dim=head_dim,
                                                          impl="pallas")
        np.testing.assert_array_equal(np.asarray(dispatched, F32), np.asarray(out, F32))
    unrotated = gmt.block_diagonal_matmul_tpu(x, values, fmt=qfmt, scale=scale, layer=layer, interpret=True)
    assert np.abs(np.asarray(out.astype(F32)) - np.asarray(unrotated.astype(F32))).max() > 1e-2


def test_block_diagonal_matmul_rope_lanes():
    """Each row's rope as the lanes that rotate a head's last 128 columns back: cos on both
    members of a pair, sin signed for the inverse's member (+sin on the even dim, -sin on the odd
    one), and 1 and 0 on the NoPE lanes before them."""
    cos, sin = _rope(2, 32, seed=0)
    lanes_cos, lanes_sin = gmt.rope_lanes((cos, sin), 512)
    assert lanes_cos.shape == lanes_sin.shape == (2, 128)
    np.testing.assert_array_equal(lanes_cos[:, :64], 1.0)
    np.testing.assert_array_equal(lanes_sin[:, :64], 0.0)
    np.testing.assert_array_equal(lanes_cos[:, 64::2], cos)
    np.testing.assert_array_equal(lanes_cos[:, 65::2], cos)
    np.testing.assert_array_equal(lanes_sin[:, 64::2], sin)
    np.testing.assert_array_equal(lanes_sin[:, 65::2], -sin)


def test_block_diagonal_matmul_shapes():
    """The TPU form takes blocks of whole lanes (and heads of whole lanes with rope); elsewhere
    `block_diagonal_matmul` re-lays x out instead, with the same result. A rope that does not fit
    x's heads is a ValueError naming the shapes."""
    assert gmt.block_diagonal_supported(4096, 1024, None, 512)
    assert not gmt.block_diagonal_supported(192, 128, None, None)
    assert not gmt.block_diagonal_supported(256, 128, "fp4", None)
    assert not gmt.block_diagonal_supported(256, 128, None, 64)
    with pytest.raises(ValueError, match="blocks are not whole lanes"):
        gmt.block_diagonal_matmul_tpu(jnp.zeros((8, 384), BF16), jnp.zeros((2, 128, 192), BF16))
    w = _weight("bf16", (2,), 96, 192, seed=1)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 384)), BF16)
    cs = _rope(5, 8, seed=1)
    out = pallas_kernels.block_diagonal_matmul(x, w, x_rope=cs, head_dim=64, impl="pallas")
    _check(out, pallas_kernels.block_diagonal_matmul(x, w, x_rope=cs, head_dim=64, impl="ref"), [5])
    with pytest.raises(ValueError, match=r"x_rope \[\(5, 8\), \(5, 8\)\] for x \(5, 384\) in heads of head_dim 100"):
        pallas_kernels.block_diagonal_matmul(x, w, x_rope=cs, head_dim=100)


@pytest.mark.parametrize("m", [8, 512], ids=["decode", "prefill"])
@pytest.mark.parametrize("target", TPU_TARGETS)
def test_block_diagonal_matmul_compiles_for_tpu(target, m):
    """Flash's grouped output projection (8 groups of 8 heads x 512, rotated back at the rows'
    angles, times wo_a's bf16 blocks `[8, 1024, 4096]`, one layer of a stack) through
    `block_diagonal_matmul(impl="pallas")`: the grouped kernel alone, no op copies or re-lays out
    the stack, and none holds x's blocks as groups of rows `[8, M, 4096]` (nor the output's)."""
    e, n, k = 8, 1024, 4096
    stack = S((3, e, n, k), BF16)

    def fn(x, w, layer, cos, sin):
        return pallas_kernels.block_diagonal_matmul(x, w, layer=layer, x_rope=(cos, sin), head_dim=512,
                                                    impl="pallas")

    result = aot.compile_for(target, jax.jit(fn), S((m, e * k), BF16), stack, S((), jnp.int32), S((m, 32), F32),
                             S((m, 32), F32))
    assert aot.kernel_calls(result.compiled, "tpu") == ["dsv4_grouped_matmul"]
    hlo = result.compiled.as_text()
    assert _stack_ops(hlo, stack) == []
    for shape in (f"{e},{m},{k}", f"{e * m},{k}", f"{e},{m},{n}", f"{e * m},{n}"):
        assert f"[{shape}]" not in hlo, shape


# ----------------------------------------------------------------------------- the first half, fused

# (format, x dtype, E, N, K, M, group sizes, (TM, TN) or None for the kernel's own, layers, the
# clamp): decode rows (fewer than E, TM 16), a prefill chunk's, small tiles that groups
# straddle, N and K off the lanes, FP4 scales read as stored (K / 32 a multiple of 128) and
# transposed, one group holding every row, rows past every group, no row chosen, a layer of a
# stack; with and without the clamp.
SWIGLU = {
    "fp4-decode-bf16": ("fp4", BF16, 8, 200, 300, 3, "padded", None, None, 0.7),
    "fp4-k4096-bf16": ("fp4", BF16, 4, 128, 4096, 8, "spread", None, 2, 0.0),
    "fp8-tiles-fp32": ("fp8", F32, 6, 300, 200, 70, [5, 0, 20, 1, 0, 30], (16, 128), None, 0.7),
    "fp8-prefill-bf16": ("fp8", BF16, 8, 384, 256, 512, "spread", None, None, 0.0),
    "bf16-one-group": ("bf16", BF16, 6, 256, 128, 64, "one", None, None, 0.7),
    "fp32-none-chosen": ("fp32", F32, 4, 136, 200, 40, [0, 0, 0, 0], (16, 128), None, 0.0),
    "fp4-tiles-fp32": ("fp4", F32, 4, 256, 192, 512, "padded", (64, 128), 3, 0.7),
}


def _first_half_operands(case):
    fmt, dtype, e, n, k, m, kind, block, layers, _ = SWIGLU[case]
    lead = (layers, e) if layers else (e,)
    w1, w3 = _weight(fmt, lead, n, k, seed=n + k), _weight(fmt, lead, n, k, seed=n + k + 1)
    x = jnp.asarray(np.random.default_rng(m * k).standard_normal((m, k)), dtype)
    sizes = np.asarray(kind, np.int32) if isinstance(kind, list) else _sizes(m, e, kind, seed=m + e)
    hw = np.random.default_rng(m).uniform(0.05, 1.0, m).astype(np.float32)
    hw[int(np.sum(sizes)):] = np.nan  # an exchange's unset rows: never read
    layer = jnp.int32(layers - 1) if layers else None
    return x, w1, w3, sizes, jnp.asarray(hw), layer, block


def _stored_pair(w):
    return (w.values, w.scale) if hasattr(w, "fmt") else (w, None)


@pytest.mark.parametrize("case", list(SWIGLU))
def test_grouped_swiglu_tpu_equals_the_unfused_kernel(case):
    """`grouped_swiglu_tpu` (the Pallas interpreter) against `grouped_matmul_tpu` twice at the
    same tiles and `swiglu` times the routing weights: equal (the same products, each rounded to
    x's dtype, then the same fp32 ops), with and without the clamp; rows past the groups zero
    although their routing weights are NaN."""
    x, w1, w3, sizes, hw, layer, block = _first_half_operands(case)
    limit = SWIGLU[case][-1]
    fmt, m, n = getattr(w1, "fmt", None), x.shape[0], w1.shape[-2]
    g = jnp.asarray(sizes)
    block = block or gmt.tiles(m, n, x.shape[1], w1.shape[-3], fmt, x.dtype.itemsize,
                               _stored_pair(w1)[0].dtype.itemsize, weights=2)
    out = gmt.grouped_swiglu_tpu(x, _stored_pair(w1), _stored_pair(w3), g, hw, fmt=fmt, limit=limit, layer=layer,
                                 interpret=True, block_shape=block)
    h1, h3 = (gmt.grouped_matmul_tpu(x, _stored_pair(w)[0], g, fmt=fmt, scale=_stored_pair(w)[1], layer=layer,
                                     interpret=True, block_shape=block) for w in (w1, w3))
    want = np.asarray((swiglu(h1, h3, limit) * hw[:, None]).astype(x.dtype), np.float32)
    got = np.asarray(out, np.float32)
    total = int(np.sum(sizes))
    assert out.dtype == x.dtype and out.shape == (m, n)
    assert np.array_equal(got[:total], want[:total]) and np.all(got[total:] == 0.0)
    if total:
        assert np.abs(got[:total]).max() > 0.01


def test_grouped_swiglu_tpu_tiles_and_bad_input():
    """A prefill round under expert parallelism on 8 devices (6,144 rows over 32 experts of
    Flash's w1 and w3, FP4) keeps the unfused kernel's two column tiles (x read twice, not
    four times) with a smaller TM, both weights' tiles within the VMEM budget; decode keeps TM
    16. Weights that differ, or routing weights not one per row: a ValueError naming them."""
    assert gmt.tiles(6144, 2048, 4096, 32, "fp4", 2, 1) == (256, 1024)
    assert gmt.tiles(6144, 2048, 4096, 32, "fp4", 2, 1, weights=2) == (128, 1024)
    assert gmt.vmem_bytes(128, 1024, 2048, 4096, 32, "fp4", 2, 1, weights=2) <= gmt.VMEM_BUDGET
    assert gmt.tiles(8, 2048, 4096, 256, "fp4", 2, 1, weights=2)[0] == 16
    w = _weight("fp4", (4,), 64, 128, seed=0)
    x, g = jnp.zeros((8, 128), BF16), jnp.asarray([2, 2, 2, 2], jnp.int32)
    other = _weight("fp4", (4,), 128, 128, seed=0)
    with pytest.raises(ValueError, match=r"grouped_swiglu_tpu: w1 \[4, 64, 64\] and w3 \[4, 128, 64\] must match"):
        gmt.grouped_swiglu_tpu(x, _stored_pair(w), _stored_pair(other), g, jnp.ones(8), fmt="fp4", limit=0.0)
    with pytest.raises(ValueError, match=r"hw \(8, 1\) must be \[M\]"):
        gmt.grouped_swiglu_tpu(x, _stored_pair(w), _stored_pair(w), g, jnp.ones((8, 1)), fmt="fp4", limit=0.0)


# (format, M, E, layers): Flash's w1 and w3 ([2048, 4096] each): decode rows of all 256 experts,
# a prefill round's rows under expert parallelism on 8 devices (32 experts each), FP8's prefill.
COMPILED_SWIGLU = {
    "fp4-decode-layers": ("fp4", 8, 256, 2),
    "fp4-prefill-ep8-layers": ("fp4", 6144, 32, 2),
    "fp8-prefill": ("fp8", 3072, 256, None),
}


@pytest.mark.parametrize("case", list(COMPILED_SWIGLU))
@pytest.mark.parametrize("target", TPU_TARGETS)
def test_grouped_swiglu_tpu_compiles_and_reads_both_weights_once(target, case):
    """The fused kernel alone in the compiled program; its declared cost (what dsv4-plan counts,
    `plan.GROUPED_KERNELS`: two weights) and the program's are at least both weights' stored
    bytes of the experts the rows may choose, the declared one at most 10% more than those, x
    once per column tile, the routing weights and the output; no op but the kernel copies or
    re-lays out either stack."""
    fmt, m, e, layers = COMPILED_SWIGLU[case]
    n, k = 2048, 4096
    lead = (layers, e) if layers else (e,)
    w1, w3 = _stored(fmt, lead, n, k), _stored(fmt, lead, n, k)
    args = [S((m, k), BF16), S((e,), jnp.int32), S((m,), F32), *w1, *w3] + ([S((), jnp.int32)] if layers else [])

    def fn(x, g, hw, *rest):
        (a1, b1, a3, b3), layer = (rest[:4], rest[4] if layers else None)
        return gmt.grouped_swiglu_tpu(x, (a1, b1), (a3, b3), g, hw, fmt=fmt, limit=10.0, layer=layer)

    result = aot.compile_for(target, jax.jit(fn), *args)
    assert aot.kernel_calls(result.compiled, "tpu") == ["dsv4_grouped_swiglu"]
    per_expert = sum(a.size * a.dtype.itemsize for a in w1) // (layers or 1) // e
    chosen = 2 * min(e, m) * per_expert
    declared = report._tpu_facts(result.compiled)["declared_cost"]["bytes_accessed"]
    _, tn = gmt.tiles(m, n, k, e, fmt, 2, 1, weights=2)
    assert result.cost["bytes accessed"] >= declared >= chosen
    assert declared <= 1.1 * (chosen + (n // tn) * m * (2 * k + 4) + 2 * m * n)
    hlo = result.compiled.as_text()
    assert [op for a in w1 for op in _stack_ops(hlo, a)] == []


# ----------------------------------------------------------------------------- rows in pieces

# (format, x dtype, E, N, K, M, group sizes): rows in two pieces `[M, 2, K/2]` (the layout of the
# ragged exchange's bf16 rows on TPU) at decode (rows off the 16-row tile) and prefill sizes; a K
# or N whose halves are not whole lanes (x then flattened, the output reshaped after).
PIECES = {
    "fp4-decode": ("fp4", BF16, 8, 512, 256, 13, "padded"),
    "fp8-prefill": ("fp8", BF16, 6, 256, 512, 512, "spread"),
    "bf16-one-group": ("bf16", BF16, 4, 256, 256, 64, "one"),
    "fp32-off-lanes": ("fp32", F32, 4, 200, 300, 40, "padded"),
}


@pytest.mark.parametrize("case", list(PIECES))
def test_rows_in_pieces(case):
    """x `[M, 2, K/2]` and the output as `[M, 2, N/2]` (`out_pieces`) through the kernels (the
    Pallas interpreter, impl="pallas"): the same values as x `[M, K]` and `[M, N]`, exactly,
    for `grouped_matmul` and `grouped_swiglu`; the reference gives the same shapes. The kernel
    takes the pieces as they are where `in_pieces` allows (its x block and output block in
    pieces, the output in one column tile)."""
    fmt, dtype, e, n, k, m, kind = PIECES[case]
    w1, w3 = _weight(fmt, (e,), n, k, seed=n + k), _weight(fmt, (e,), n, k, seed=n + k + 1)
    x = jnp.asarray(np.random.default_rng(m * k).standard_normal((m, k)), dtype)
    sizes = _sizes(m, e, kind, seed=m + e)
    g, hw = jnp.asarray(sizes), jnp.asarray(np.random.default_rng(m).uniform(0.05, 1.0, m), F32)
    pieces = x.reshape(m, 2, k // 2)
    flat = np.asarray(grouped_matmul(x, w1, g, impl="pallas"), np.float32)
    out = grouped_matmul(pieces, w1, g, out_pieces=2, impl="pallas")
    assert out.shape == (m, 2, n // 2) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32).reshape(m, n), flat)
    assert grouped_matmul(pieces, w1, g, out_pieces=2, impl="ref").shape == (m, 2, n // 2)
    np.testing.assert_array_equal(np.asarray(pallas_kernels.grouped_swiglu(pieces, w1, w3, g, hw, limit=1.0,
                                                                           impl="pallas"), np.float32),
                                  np.asarray(pallas_kernels.grouped_swiglu(x, w1, w3, g, hw, limit=1.0,
                                                                           impl="pallas"), np.float32))
    stored = fmt if fmt in ("fp8", "fp4") else None
    assert gmt.in_pieces(k, 2, stored) == gmt.in_pieces(n, 2) == (case != "fp32-off-lanes")
    _, tn, whole = gmt.output_tiles(m, n, k, e, stored, x.dtype.itemsize, _stored_pair(w1)[0].dtype.itemsize, 2)
    assert whole == gmt.in_pieces(n, 2) and (tn == n or not whole)
    with pytest.raises(ValueError, match="out_pieces 3 does not divide the output's width"):
        grouped_matmul(x, w1, g, out_pieces=3)


def test_output_in_pieces_falls_back_when_the_width_does_not_fit():
    """An output in pieces needs the whole width in one column tile; where no row tile fits
    beside it in VMEM (a wide FP8 weight), the kernel tiles as usual and XLA re-lays its output
    out: `output_tiles` says so."""
    tm, tn, whole = gmt.output_tiles(64, 16384, 8192, 8, "fp8", 2, 1, 2)
    assert not whole and (tm, tn) == gmt.tiles(64, 16384, 8192, 8, "fp8", 2, 1)
    with pytest.raises(ValueError, match="too wide"):
        gmt.tiles(64, 16384, 8192, 8, "fp8", 2, 1, whole_width=True)


@pytest.mark.parametrize("target", TPU_TARGETS)
def test_rows_in_pieces_compile_in_place(target):
    """Flash's routed experts in a prefill round of the ragged exchange on 8 devices (6,144 rows,
    32 experts of each FP4 stack, one layer of 2): the first half reads x `[6144, 2, 2048]` and
    the second half writes `[6144, 2, 2048]` in the layout XLA gives them (a (2, 128) tile's two
    sublanes a row), so the compiled program holds no op but the kernels that produces an array
    of x's or the output's shape: nothing re-lays the rows out around the kernels."""
    m, e, d, i = 6144, 32, 4096, 2048
    up, down = _stored("fp4", (2, e), i, d), _stored("fp4", (2, e), d, i)
    args = [S((m, 2, d // 2), BF16), S((e,), jnp.int32), S((m,), F32), S((), jnp.int32), *up, *up, *down]

    def fn(x, g, hw, layer, v1, s1, v3, s3, v2, s2):
        h = gmt.grouped_swiglu_tpu(x, (v1, s1), (v3, s3), g, hw, fmt="fp4", limit=10.0, layer=layer)
        return gmt.grouped_matmul_tpu(h, v2, g, fmt="fp4", scale=s2, layer=layer, out_pieces=2)

    result = aot.compile_for(target, jax.jit(fn), *args)
    assert aot.kernel_calls(result.compiled, "tpu") == ["dsv4_grouped_swiglu", "dsv4_grouped_matmul"]
    hlo = result.compiled.as_text()
    rows = f"bf16[{m},2,{d // 2}]"
    producers = [line.strip()[:160] for line in hlo.splitlines()
                 if re.match(rf"\s*(ROOT )?%\S+ = {re.escape(rows)}", line)
                 and " parameter(" not in line and "tpu_custom_call" not in line]
    assert producers == []
    assert re.search(rf"{re.escape(rows)}\{{2,1,0:T\(2,128\)\(2,1\)[^}}]*\}} custom-call", hlo)
