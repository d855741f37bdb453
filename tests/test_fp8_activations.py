"""FP8-activation matmul (pallas_kernels/fp8_activations*.py): `act_quant` bit for bit against a
numpy model of DeepSeek's reference rounding, `fp8_activation_matmul_ref` against a float64
model of the whole GEMM, the Mosaic TPU and Pallas-Triton kernels in the Pallas interpreter on
CPU against the reference, the TPU kernel's compile for v5p-8 and tpu7x-8 (its matmuls on e4m3
operands) and the GPU kernel's for an H100 (XLA's CUDA compiler, Triton and ptxas, sm_90a, no GPU
needed), whose PTX must use the FP8 tensor cores.

Tolerances. The numpy model is independent of the JAX code: scales from `np.frexp` (2^ceil(log2
y)), not from y's bits; the e4m3 cast by ml_dtypes (round to nearest even). The GEMM model sums
the dequantized blocks (x̃ = q_x s_x, w̃ = q_w s_w) in float64, exactly enough. In the reference
every product is exact in fp32 (e4m3 values have 4 significant bits, power-of-two scales only
shift them), so its only errors are fp32 roundings: at most 127 additions inside a block, one
multiplication by the scales (exact for power-of-two weight scales, one rounding for float ones),
Kb - 1 additions of the blocks; so per output |ref - model| <= (128 + Kb) 2^-24 sum_k |x̃_k w̃_k| (`_bound`, the
first-order bound of recursive fp32 summation; unit roundoff 2^-24). bf16 output adds its
one rounding, at most 2^-8 |value|. Kernel against reference (`_close`): both within `_bound` of
the same model, so 2 `_bound` apart in fp32; in bf16 the two roundings may then differ by one
bf16 ulp, at most 2^-7 |ref|. The interpreter runs the kernels' block dots in fp32 like the
reference (the GPU kernel's agree with it bit for bit in practice, the TPU kernel's sum the
products of a block in another order); the bounds do not assume either. On a GPU the
kernel's in-block sums are the FP8 MMA's (fewer bits than fp32, as DeepSeek's own kernel):
nothing here runs on a GPU, and the compile tests prove the kernel lowers for sm_90a to FP8
wgmma, not its speed or the MMA's rounding.
"""

from __future__ import annotations

import os
import re
import tempfile

from dsv4_jax.tools import aot  # first: it lets JAX's CUDA plugin register without a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_kernels import _fp8_weight  # noqa: E402

from dsv4_jax.model.quantized import QuantizedWeight  # noqa: E402
from pallas_kernels import fp8_activations_gpu as fag  # noqa: E402
from pallas_kernels import fp8_activations_tpu as fat  # noqa: E402
from pallas_kernels.fp8_activations import act_quant, fp8_activation_matmul, fp8_activation_matmul_ref  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32, E4M3 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
BLOCK = 128


# ----------------------------------------------------------------------------- numpy models

def np_act_quant(x, block=BLOCK):
    """The reference's activation quantization in numpy: (q e4m3 `[..., K]`, s float32 `[..., Kb]`)."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    blocks = -(-k // block)
    q = np.empty(x.shape, ml_dtypes.float8_e4m3fn)
    s = np.empty(x.shape[:-1] + (blocks,), np.float32)
    for b in range(blocks):
        part = x[..., b * block:(b + 1) * block]
        amax = np.maximum(np.abs(part).max(axis=-1), np.float32(1e-4))
        y = amax * np.float32(1 / 448)  # float32 times float32: rounded in float32
        mantissa, exponent = np.frexp(y)  # y = mantissa 2^exponent, mantissa in [0.5, 1)
        e = np.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2 y)
        s[..., b] = np.ldexp(np.float32(1), e)
        q[..., b * block:(b + 1) * block] = np.clip(part / s[..., b, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, s


def _dequantized(x, w):
    """x̃ `[M, K]` and w̃ `[N, K]` in float64: the quantized operands times their scales."""
    q, s = np_act_quant(x)
    m, k = q.shape
    n = w.shape[0]
    xd = q.astype(np.float64) * np.repeat(s, BLOCK, axis=-1)[:, :k]
    ws = np.repeat(np.repeat(np.asarray(w.scale, np.float64), BLOCK, axis=0), BLOCK, axis=1)[:n, :k]
    return xd, np.asarray(w.values.astype(F32), np.float64) * ws


def np_gemm(x, w):
    """The reference GEMM in float64 (sum of the dequantized blocks' products) `[M, N]`."""
    xd, wd = _dequantized(x, w)
    return xd @ wd.T


def _bound(x, w):
    """Per output, the fp32 rounding bound of the module doc (times 1 + 2^-16 for the second-order
    terms, n u / (1 - n u) with n u < 2^-16 here)."""
    xd, wd = _dequantized(x, w)
    return (BLOCK + -(-x.shape[-1] // BLOCK)) * 2.0 ** -24 * (1 + 2.0 ** -16) * (np.abs(xd) @ np.abs(wd).T)


def _close(out, ref, bound):
    """Kernel output against the reference output (module doc)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp = 2.0 ** -7 if out.dtype == BF16 else 0.0
    out, ref = np.asarray(out.astype(F32), np.float64), np.asarray(ref.astype(F32), np.float64)
    assert np.isfinite(out).all()
    assert (np.abs(out - ref) <= 2 * bound + ulp * np.abs(ref)).all()


def _wide_range_x(m, k, seed, dtype=BF16):
    """Random x `[m, k]` whose blocks span a wide dynamic range: each element normal times
    2^[-30, 30), each row's blocks scaled by 2^[-40, 40)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * 2.0 ** rng.integers(-30, 30, (m, k))
    x *= np.repeat(2.0 ** rng.integers(-40, 40, (m, -(-k // BLOCK))), BLOCK, axis=1)[:, :k]
    return np.array(jnp.asarray(x, dtype).astype(F32))


def _special_rows(k, dtype):
    """Rows `[8, k]` with the cases the rounding is easy to get wrong on: an all-zero block, a
    block of tiny values (amax under the 1e-4 floor), amax exactly 448 2^j (scale 2^j, q = 448),
    amax 440 2^j (rounds up to q = 448 under scale 2^j), amax just over 448 2^j (the next
    scale), ties of e4m3 rounding, bf16 / fp32 extremes, and a partial last block."""
    rng = np.random.default_rng(k)
    rows = rng.standard_normal((8, k))
    rows[0, :BLOCK] = 0.0
    rows[1, :BLOCK] = rng.standard_normal(BLOCK) * 1e-7
    rows[1, BLOCK:] = rng.standard_normal(k - BLOCK) * 3e-5
    rows[2, :BLOCK] *= 0.01
    rows[2, 5] = 448.0 * 2.0 ** -3
    rows[3, :BLOCK] *= 0.1
    rows[3, 7] = -440.0 * 2.0 ** 10
    rows[3, 8] = 440.0 * 2.0 ** 10
    rows[4, :BLOCK] = np.clip(rows[4, :BLOCK], -1, 1) * 2.0 ** -20
    rows[4, 9] = 452.0 * 2.0 ** -20  # the bf16 after 448
    # Halfway between e4m3 neighbours under scale 1 (amax 448): 0.5 + 1/32 (ties to even: 0.5),
    # 17 (16 or 18: to 16), 19 (18 or 20: to 20), 432 (416 or 448: to 448).
    rows[5, :6] = [448.0, 0.53125, 17.0, 19.0, -432.0, 1.0]
    rows[6] *= 1e30 if dtype == F32 else 1e36
    rows[7, -1] = 1e3  # only in the last (partial) block
    return np.array(jnp.asarray(rows, dtype).astype(F32))


# ----------------------------------------------------------------------------- act_quant

@pytest.mark.parametrize("k, dtype", [(300, BF16), (1024, BF16), (300, F32), (64, BF16)])
def test_act_quant_matches_the_numpy_model_bit_for_bit(k, dtype):
    x = np.concatenate([_wide_range_x(40, k, seed=k, dtype=dtype)] + ([_special_rows(k, dtype)] if k > BLOCK else []))
    q, s = jax.jit(act_quant)(jnp.asarray(x, dtype))
    mq, ms = np_act_quant(x)
    assert q.dtype == E4M3 and q.shape == x.shape and s.dtype == F32 and s.shape == (x.shape[0], -(-k // BLOCK))
    np.testing.assert_array_equal(np.asarray(s), ms)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), mq.view(np.uint8))
    # Scales are powers of two; the cases of `_special_rows` came out as their doc says.
    assert (np.frexp(np.asarray(s))[0] == 0.5).all()
    if k > BLOCK:
        special = np.asarray(q[40:].astype(F32))
        assert (special[0, :BLOCK] == 0).all() and s[40, 0] == 2.0 ** np.ceil(np.log2(np.float32(1e-4) / 448))
        assert special[2, 5] == 448 and s[42, 0] == 2.0 ** -3
        assert special[3, 7] == -448 and special[3, 8] == 448 and s[43, 0] == 2.0 ** 10
        assert s[44, 0] == 2.0 ** -19
        assert list(special[5, :6]) == [448, 0.5, 16, 20, -448, 1]


def test_act_quant_keeps_leading_axes_and_other_blocks():
    x = _wide_range_x(6, 160, seed=3).reshape(2, 3, 160)
    q, s = act_quant(jnp.asarray(x, BF16), block=64)
    mq, ms = np_act_quant(x, block=64)
    assert q.shape == (2, 3, 160) and s.shape == (2, 3, 3)
    np.testing.assert_array_equal(np.asarray(s), ms)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), mq.view(np.uint8))


# ----------------------------------------------------------------------------- the reference GEMM

@pytest.mark.parametrize("m, n, k, dtype, float_scales", [(5, 200, 300, F32, False), (9, 256, 384, F32, True),
                                                           (7, 136, 260, BF16, False)])
def test_ref_matches_the_float64_model(m, n, k, dtype, float_scales):
    w = _fp8_weight(n, k, dtype, seed=n, float_scales=float_scales)
    x = _wide_range_x(m, k, seed=m)
    x[0] = _special_rows(k, BF16)[2]
    out = jax.jit(fp8_activation_matmul_ref)(jnp.asarray(x, dtype), w)
    assert out.shape == (m, n) and out.dtype == dtype
    model = np_gemm(x, w)
    err = np.abs(np.asarray(out.astype(F32), np.float64) - model)
    rounding = 2.0 ** -8 * np.abs(model) if dtype == BF16 else 0
    assert (err <= _bound(x, w) + rounding).all()


# ----------------------------------------------------------------------------- the kernels, interpreted

def _interpreted(kernel):
    """fp8_activation_matmul(x, w, layer=) by `kernel` ("tpu" or "gpu") in the Pallas interpreter."""
    if kernel == "tpu":  # impl "pallas" off TPU and CUDA
        return lambda x, w, layer=None: fp8_activation_matmul(x, w, layer=layer, impl="pallas")
    matmul = fag.fp8_activation_matmul_gpu

    def run(x, w, layer=None):
        q, s = act_quant(x.reshape(-1, x.shape[-1]))
        out = matmul(q, s, w.values, w.scale, out_dtype=x.dtype, layer=layer, interpret=True)
        return out.reshape(x.shape[:-1] + (w.shape[-2],))
    return run


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
@pytest.mark.parametrize("m, n, k", [(1, 200, 300), (3, 200, 300), (8, 300, 700), (64, 200, 300), (512, 200, 300),
                                     (64, 136, 256), (40, 384, 1024)])
def test_kernel_matches_ref(kernel, m, n, k):
    """M from decode (one row tile; the GPU kernel's 64 rows in 16-row weight tiles) to a
    512-token chunk (several row and column tiles); N off the 128 blocks, K off them (the
    masked K tail) and on them."""
    w = _fp8_weight(n, k, BF16, seed=m + n)
    x = jnp.asarray(_wide_range_x(m, k, seed=k + m), BF16)
    out = _interpreted(kernel)(x, w)
    assert out.shape == (m, n) and out.dtype == BF16
    _close(out, fp8_activation_matmul_ref(x, w), _bound(np.asarray(x.astype(F32)), w))


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_reads_a_layer_of_a_stack(kernel):
    """With `layer` traced, x with leading axes, in bf16 and fp32."""
    parts = [_fp8_weight(200, 300, F32, seed=s) for s in (21, 22)]
    stack = QuantizedWeight(jnp.stack([p.values for p in parts]), jnp.stack([p.scale for p in parts]), fmt="fp8")
    x = _wide_range_x(6, 300, seed=5).reshape(2, 3, 300)
    for dtype in (BF16, F32):
        xj = jnp.asarray(x, dtype)
        run = jax.jit(lambda x, w, i: _interpreted(kernel)(x, w, layer=i))
        for i in (1, 0):
            out = run(xj, stack, jnp.int32(i))
            assert out.shape == (2, 3, 200) and out.dtype == dtype
            ref = fp8_activation_matmul_ref(xj.reshape(6, 300), parts[i]).reshape(2, 3, 200)
            _close(out, ref, _bound(x.reshape(6, 300), parts[i]).reshape(2, 3, 200))


def test_kernel_tiles_and_errors():
    # GPU decode: one 64-row tile (wgmma's rows), the weight split for 2 programs per SM; prefill:
    # 128 x 128, shrunk (TN first) below one program per SM.
    assert fag.tiles(1, 4096) == (64, 16)
    assert fag.tiles(64, 65536) == (64, 128)
    assert fag.tiles(2048, 7168) == (128, 128)
    assert fag.tiles(512, 3072) == (128, 64)
    # TPU: rows in whole e4m3 tiles of 32 up to 512, the weight in quantized_matmul's tiles
    assert fat.tiles(1, 4096, 4096) == (32, 512, 1024)
    assert fat.tiles(2048, 200, 300) == (512, 256, 384)
    w = _fp8_weight(200, 300, BF16, seed=1)
    x = jnp.zeros((4, 300), BF16)
    with pytest.raises(ValueError, match=r"x \(4, 256\) and an fp8 weight \[200, 300\]"):
        fp8_activation_matmul(jnp.zeros((4, 256), BF16), w)
    with pytest.raises(ValueError, match=r"needs an fp8 QuantizedWeight \[L, N, K\]"):
        fp8_activation_matmul(x, w, layer=0)
    fp4 = QuantizedWeight(jnp.zeros((200, 150), jnp.uint8), jnp.zeros((200, 10), jnp.uint8), fmt="fp4")
    with pytest.raises(ValueError, match=r"an fp4 weight \[200, 300\]"):
        fp8_activation_matmul(x, fp4)
    with pytest.raises(ValueError, match=r"a ndarray|a Array|a ArrayImpl"):
        fp8_activation_matmul(x, jnp.zeros((200, 300), BF16))
    with pytest.raises(ValueError, match="impl must be one of"):
        fp8_activation_matmul(x, w, impl="triton")
    q, s = act_quant(x)
    with pytest.raises(ValueError, match="powers of two"):
        fag.fp8_activation_matmul_gpu(q, s, w.values, w.scale, out_dtype=BF16, block_shape=(32, 16))
    with pytest.raises(ValueError, match=r"s \[4, 2\]"):
        fag.fp8_activation_matmul_gpu(q, s[:, :2], w.values, w.scale, out_dtype=BF16)
    with pytest.raises(ValueError, match=r"TK of 128 dividing K rounded up to 128 \(384\)"):
        fat.fp8_activation_matmul_tpu(q, s, w.values, w.scale, out_dtype=BF16, block_shape=(32, 128, 256))
    with pytest.raises(ValueError, match=r"scales s \[4, 2\] for q \[4, 300\]: needs \[4, 3\]"):
        fat.fp8_activation_matmul_tpu(q, s[:, :2], w.values, w.scale, out_dtype=BF16)


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
@pytest.mark.parametrize("m, n, k", [(1, 32768, 1024), (8, 4096, 4096), (2048, 7168, 2048), (3, 200, 300)])
def test_kernel_declared_cost(kernel, m, n, k):
    """The pallas_call's CostEstimate: 2 M N K flops; bytes at least what is stored and read (the
    weight's values and scales, x's e4m3 values and scales) and the bf16 output written."""
    kb = -(-k // BLOCK)
    args = (S((m, k), E4M3), S((m, kb), F32), S((n, k), E4M3), S((-(-n // BLOCK), kb), F32))
    matmul = fat.fp8_activation_matmul_tpu if kernel == "tpu" else fag.fp8_activation_matmul_gpu
    jaxpr = jax.make_jaxpr(lambda *a: matmul(*a, out_dtype=BF16))(*args)
    [cost] = [e.params["cost_estimate"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert cost.flops == 2 * m * n * k
    assert cost.bytes_accessed >= n * k + 4 * -(-n // BLOCK) * kb + m * k + 4 * m * kb + 2 * m * n


# ----------------------------------------------------------------------------- compiled for an H100

# (M, N, K, layers): Flash decode at batch 8 (a 4096 x 4096 projection), a 2048-token prefill
# chunk, a small shape off the blocks, and decode reading one layer of a stack of three.
COMPILE = {
    "decode8": (8, 4096, 4096, None),
    "prefill2048": (2048, 1024, 4096, None),
    "odd": (3, 200, 300, None),
    "decode8-layer": (8, 1024, 4096, 3),
}


@pytest.mark.parametrize("case", COMPILE)
def test_kernel_compiles_for_h100_with_fp8_tensor_cores(case):
    """Through `fp8_activation_matmul` (impl "auto"), the program compiled for an H100 holds one
    Pallas kernel, this one, as XLA's Triton call; no other op touches the weight (a copy or
    re-layout of it would be an instruction of its shape; a bitcast, such as the one layer seen
    as a stack of one, is a view); and the kernel's PTX multiplies on
    the FP8 tensor cores (wgmma with e4m3 operands, of the tile's width) and on nothing else (no
    f16/bf16 MMA: the e4m3 tiles are not widened)."""
    m, n, k, layers = COMPILE[case]
    lead = () if layers is None else (layers,)
    args = (S((m, k), BF16), S(lead + (n, k), E4M3), S(lead + (-(-n // BLOCK), -(-k // BLOCK)), F32))
    if layers is None:
        def fn(x, v, s):
            return fp8_activation_matmul(x, QuantizedWeight(v, s, fmt="fp8"))
    else:
        args += (S((), jnp.int32),)

        def fn(x, v, s, i):
            return fp8_activation_matmul(x, QuantizedWeight(v, s, fmt="fp8"), layer=i)

    with tempfile.TemporaryDirectory() as dump:
        compiled = aot.compile_for("h100x1", jax.jit(fn), *args,
                                   compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "NONE"}).compiled
        entry = re.compile(rf"^(\.visible\s+)?\.entry\s+{fag.KERNEL_NAME}\(", re.M)
        ptx = [text for f in sorted(os.listdir(dump)) if f.endswith(".ptx")
               for text in [open(os.path.join(dump, f)).read()] if entry.search(text)]
    assert aot.kernel_calls(compiled, "cuda") == [fag.KERNEL_NAME]
    text = compiled.as_text()
    [call] = [line for line in text.splitlines() if f'custom_call_target="{aot.TRITON_CALL}"' in line]
    assert f'name = "{fag.KERNEL_NAME}"' in call
    shapes = rf"(\d+,)?{n},{k}"
    assert [line for line in text.splitlines()
            if re.search(rf"= f8e4m3fn\[{shapes}\]", line) and not re.search(r" (parameter|bitcast)\(", line)] == []
    [ptx] = ptx
    assert re.search(r"^\.target sm_90a", ptx, re.M)
    _, tn = fag.tiles(m, n)
    mmas = set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\.[\w.]+", ptx))
    assert mmas == {f"wgmma.mma_async.sync.aligned.m64n{tn}k32.f32.e4m3.e4m3"}, mmas


def _mosaic_matmuls(lowered_text: str) -> list[str]:
    """The operand and result types of every matmul in the Mosaic kernels of a program lowered
    for TPU (each kernel's MLIR, serialized in its custom call's backend config)."""
    import base64

    from jax._src.lib import tpu  # Mosaic's dialect: no public entry point
    from jax._src.lib.mlir import ir

    types = []
    for body in re.findall(r"body\\22: \\22([A-Za-z0-9+/=]+)\\22", lowered_text):
        context = ir.Context()
        context.allow_unregistered_dialects = True
        tpu.register_dialect(context)
        with context:
            kernel = str(ir.Module.parse(base64.b64decode(body)))
        types += [re.sub(r"^\(|\)$", "", line.rsplit(" : ", 1)[1].split(" -> ")[0])
                  for line in kernel.splitlines() if "tpu.matmul" in line]
    return types


@pytest.mark.parametrize("target", ["v5p-8", "tpu7x-8"])
@pytest.mark.parametrize("m, n, k", [(8, 2048, 1024), (512, 1024, 4096)])
def test_tpu_kernel_compiles_with_fp8_operands(target, m, n, k):
    """Through `fp8_activation_matmul` (impl "auto"), the program compiled for v5p-8 (whose MXU
    takes no FP8 operands: Mosaic widens them) and tpu7x-8 (whose MXU multiplies FP8) holds one
    Pallas kernel, this one; no instruction but the parameter holds the weight (no copy or
    re-laid-out weight in HBM); every matmul of the kernel takes two e4m3 operands
    (`[rows, 128] x [128, 128]` blocks, fp32 results); and dsv4-plan counts its declared flops,
    2 M N K, as FP8 products (run at the FP8 rate where the device has one)."""
    from dsv4_jax.tools import plan

    def fn(x, v, s):
        return fp8_activation_matmul(x, QuantizedWeight(v, s, fmt="fp8"))

    args = (S((m, k), BF16), S((n, k), E4M3), S((n // BLOCK, k // BLOCK), F32))
    jitted = jax.jit(fn)
    compiled = aot.compile_for(target, jitted, *args).compiled
    text = compiled.as_text()
    assert aot.kernel_calls(compiled, "tpu") == [fat.KERNEL_NAME]
    # (tpu7x: XLA prefetches a weight this small whole into on-chip memory, S(1), in its own
    # tiling: an asynchronous copy-start / copy-done, not a re-layout)
    prefetch = re.compile(r"\S+S\(1\)\S* copy-(start|done)\(")
    assert [line for line in text.splitlines()
            if re.search(rf"= \w+\[{n},{k}\]", line) and " parameter(" not in line and not prefetch.search(line)] == []
    matmuls = _mosaic_matmuls(jitted.trace(*args).lower(lowering_platforms=("tpu",)).as_text())
    tm = fat.tiles(m, n, k)[0]
    assert matmuls and set(matmuls) == {f"vector<{tm}x128xf8E4M3FN>, vector<128x128xf8E4M3FN>, "
                                        f"vector<{tm}x128xf32>"}, set(matmuls)
    cost = plan.program_cost(text, 1.0, platform="tpu")
    assert cost["fp8_flops"] == 2 * m * n * k
    assert cost["fp8_flops"] <= cost["flops"]


def test_model_with_fp8_activations(tmp_path, monkeypatch):
    """The model with `fp8_activations` (a native FP8/FP4 conversion of the small parity config, on
    CPU: the reference's quantize-then-multiply in plain JAX for every FP8 linear, the routed
    experts' inputs rounded as `test_routed_experts_with_fp8_activations` checks) gives the
    logits of the same model whose FP8 linears multiply the dequantized act_quant of their input
    (q * s) by the dequantized weight (within 1e-5 of the largest logit: fp32 sums in another
    order), and they are not those of the activations as they are (the mode is on: e4m3 keeps
    4 significant bits, and this random model moves its logits by 7 % of the largest in bf16)."""
    import hf_oracle as H

    import dsv4_jax
    import pallas_kernels
    from convert.cli import main as convert_main
    from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
    from dsv4_jax.model import xla_cpu
    from pallas_kernels import act_quant_rounded

    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)
    write_hf_checkpoint(dsv4_jax.init_params(cfg, seed=5, std=0.1), cfg, str(tmp_path / "hf"), quantize=True)
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "native"), "--dtype", "native"]) == 0
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    plain = np.asarray(dsv4_jax.load(tmp_path / "native")(ids))
    quantized = np.asarray(dsv4_jax.load(tmp_path / "native", fp8_activations=True)(ids))

    def fake_quantized(x, w, *, layer=None, impl="auto"):
        return xla_cpu.dense(w if layer is None else w[layer], act_quant_rounded(x))

    monkeypatch.setattr(pallas_kernels, "fp8_activation_matmul", fake_quantized)
    want = np.asarray(dsv4_jax.load(tmp_path / "native", fp8_activations=True)(ids))
    scale = np.abs(want).max()
    assert np.abs(quantized - want).max() <= 1e-5 * scale
    assert np.abs(quantized - plain).max() > 0.05 * scale


def test_routed_experts_with_fp8_activations():
    """The routed experts in the mode (their FP4 weights have no FP8-activation kernel): x and
    each down projection's input rounded as `act_quant` rounds them (`moe.fp8_rounded`, bit for
    bit q s of the numpy model), then the products as usual; on CPU's blocks and the grouped form
    (TPU/GPU's, here with the grouped matmul's reference) both equal a float64 numpy composition
    of the reference's expert within fp32 sums (1e-5 of the largest output)."""
    from dsv4_jax.model import moe

    rng = np.random.default_rng(0)
    T, k, E, D, I, limit = 12, 2, 4, 256, 160, 7.0
    x = (rng.standard_normal((T, D)) * 2.0 ** rng.integers(-6, 6, (T, 1))).astype(np.float32)
    q, s = np_act_quant(x)
    rounded = np.asarray(moe.fp8_rounded(jnp.asarray(x), True))
    np.testing.assert_array_equal(rounded, q.astype(np.float32) * np.repeat(s, BLOCK, axis=-1)[:, :D])
    assert np.abs(rounded - x).max() > 0  # the rounding is on
    w1, w3 = (rng.standard_normal((E, I, D)).astype(np.float32) * 0.1 for _ in range(2))
    w2 = rng.standard_normal((E, D, I)).astype(np.float32) * 0.1
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (T, k)).astype(np.float32)

    def fp8(a):
        q, s = np_act_quant(a)
        return q.astype(np.float64) * np.repeat(s, BLOCK, axis=-1)[..., :a.shape[-1]]

    want = np.zeros((T, D))
    xr = fp8(x)
    for t in range(T):
        for j, e in enumerate(experts[t]):
            h1, h3 = w1[e] @ xr[t], w3[e] @ xr[t]
            h = np.minimum(h1, limit) / (1 + np.exp(-np.minimum(h1, limit))) * np.clip(h3, -limit, limit)
            want[t] += w2[e] @ fp8((h * weights[t, j]).astype(np.float32)[None])[0]
    args = (jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(w1), jnp.asarray(w2),
            jnp.asarray(w3), limit)
    for got in (moe.routed_experts(*args, fp8_activations=True), moe._grouped(*args[:6], limit=limit, fp8_activations=True)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    plain = np.asarray(moe.routed_experts(*args))
    assert np.abs(plain - want).max() > 1e-3 * np.abs(want).max()
