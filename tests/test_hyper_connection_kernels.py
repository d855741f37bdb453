"""The hyper-connections' kernels (`pallas_kernels.hc_collapse`, `hc_expand`): the Mosaic TPU
and the Pallas-Triton GPU kernel bodies in the Pallas interpreter against the plain-JAX
references, their declared cost, and their compiles for TPU v5p, v6e and v7x and for the H100
and H200 (the compiled program holds the kernels and no copy of the streams).

Tolerances, as tests/test_kernels.py states them: fp32 outputs within 1e-5 of the largest
reference value (both compute in fp32; the mixes' product is summed per stream, another order
than the reference's one contraction: a few fp32 ulps); bf16 outputs within 2^-6 of it with
fewer than 1 % of the elements differing (a last-bit fp32 difference can flip one bf16 rounding).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax.tools import aot, plan
from pallas_kernels import hc_collapse, hc_collapse_ref, hc_expand, hc_expand_ref
from pallas_kernels import hyper_connection_gpu as gpu
from pallas_kernels.hyper_connection_tpu import COLLAPSE_NAME, EXPAND_NAME, hc_collapse_tpu, hc_expand_tpu
from test_aot_model import _copies
from test_kernels import _check  # the kernels' tolerances (that module's doc)

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
EPS = dict(hc_eps=1e-6, norm_eps=1e-6)


def _inputs(b, s, hc, d, rows, dtype, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    x = (3 * jax.random.normal(ks[0], (b, s, hc, d))).astype(dtype)
    fn = jax.random.normal(ks[1], (rows, hc * d)) * (hc * d) ** -0.5
    base, scale = jax.random.normal(ks[2], (rows,)), jax.random.normal(ks[3], (3,))
    f = jax.random.normal(ks[4], (b, s, d)).astype(dtype)
    post = 2 * jax.nn.sigmoid(jax.random.normal(ks[5], (b, s, hc)))
    comb = jax.nn.softmax(jax.random.normal(ks[6], (b, s, hc, hc)), axis=-1)
    return x, fn, base, scale, f, post, comb


# (B, S, hc, D, mixes rows, dtype, token rows per step): hc_pre's 24 mixes and the head's 4; decode
# (S 1), a chunk in one tile, and tiles of 16 with a partial last one (B S = 40 and 3 x 13 = 39).
CASES = [(2, 1, 4, 256, 24, F32, None), (1, 40, 4, 128, 24, BF16, 16), (3, 13, 4, 384, 4, F32, 16),
         (2, 3, 2, 512, 8, BF16, None), (1, 64, 4, 128, 24, F32, None)]


@pytest.mark.parametrize("b, s, hc, d, rows, dtype, tokens", CASES)
def test_kernels_match_ref(b, s, hc, d, rows, dtype, tokens):
    x, fn, base, scale, f, post, comb = _inputs(b, s, hc, d, rows, dtype, seed=b * 100 + s)
    collapsed, m = hc_collapse_tpu(x, fn, base, scale, interpret=True, block_tokens=tokens, **EPS)
    ref_collapsed, ref_m = hc_collapse_ref(x, fn, base, scale, **EPS)
    assert collapsed.dtype == dtype and m.dtype == F32 and m.shape == (b, s, rows)
    _check(m, ref_m)
    _check(collapsed, ref_collapsed)
    out = hc_expand_tpu(f, x, post, comb, interpret=True, block_tokens=tokens)
    assert out.dtype == dtype
    _check(out, hc_expand_ref(f, x, post, comb))


# (B, S, hc, D, mixes rows, dtype): decode rows, a chunk crossing the mixes' 16-token tiles, D
# neither a power of two nor a multiple of the column chunks (520, 96), hc and R not powers of two.
GPU_CASES = [(8, 1, 4, 256, 24, F32), (1, 40, 4, 384, 24, BF16), (3, 13, 4, 128, 4, F32), (2, 3, 2, 520, 8, BF16),
             (1, 20, 3, 96, 15, F32)]


@pytest.mark.parametrize("b, s, hc, d, rows, dtype", GPU_CASES)
def test_gpu_kernels_match_ref(b, s, hc, d, rows, dtype):
    """The Pallas-Triton kernels in the interpreter: the collapse (its mixes and sum kernels), on
    a layer of a stack read in place, and the expansion, against the references."""
    x, fn, base, scale, f, post, comb = _inputs(b, s, hc, d, rows, dtype, seed=b * 10 + s)
    stack = jnp.stack([-fn, fn * 0.5])
    collapsed, m = gpu.hc_collapse_gpu(x, stack, base, scale, layer=jnp.int32(1), interpret=True, **EPS)
    ref_collapsed, ref_m = hc_collapse_ref(x, fn * 0.5, base, scale, **EPS)
    assert collapsed.dtype == dtype and m.dtype == F32 and m.shape == (b, s, rows)
    _check(m, ref_m)
    _check(collapsed, ref_collapsed)
    out = gpu.hc_expand_gpu(f, x, post, comb, interpret=True)
    assert out.dtype == dtype
    _check(out, hc_expand_ref(f, x, post, comb))


def _platform_kernels(fn, *args) -> dict[str, int]:
    """The pallas_calls in each platform's branch of a dispatched function's jaxpr, by name."""
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    counts = {name: len(re.findall(rf"name={name}(?!\w)", jaxpr))
              for name in (COLLAPSE_NAME, EXPAND_NAME, gpu.MIXES_NAME, gpu.SUM_NAME, gpu.EXPAND_NAME)}
    return {name: n for name, n in counts.items() if n}


def test_dispatch_runs_the_kernel_in_the_interpreter():
    """impl="pallas" off TPU and CUDA runs the TPU kernel in the interpreter; D off the 128 lanes
    takes the reference there and on TPU, and the GPU kernel on CUDA."""
    x, fn, base, scale, f, post, comb = _inputs(1, 5, 4, 128, 24, F32, seed=3)
    collapse = lambda *a: hc_collapse(*a, impl="pallas", **EPS)  # noqa: E731
    expand = lambda *a: hc_expand(*a, impl="pallas")  # noqa: E731
    # the TPU branch and the interpreter's, and the GPU's
    assert _platform_kernels(collapse, x, fn, base, scale) == {COLLAPSE_NAME: 2, gpu.MIXES_NAME: 1, gpu.SUM_NAME: 1}
    assert _platform_kernels(expand, f, x, post, comb) == {EXPAND_NAME: 2, gpu.EXPAND_NAME: 1}
    _check(hc_expand(f, x, post, comb, impl="pallas"), hc_expand_ref(f, x, post, comb))
    x, fn, base, scale, f, post, comb = _inputs(1, 5, 4, 96, 24, F32, seed=4)
    assert _platform_kernels(collapse, x, fn, base, scale) == {gpu.MIXES_NAME: 1, gpu.SUM_NAME: 1}
    assert _platform_kernels(expand, f, x, post, comb) == {gpu.EXPAND_NAME: 1}




@pytest.mark.parametrize("b, s", [(4, 1), (1, 512)])
def test_declared_cost_covers_the_streams(b, s):
    """Each kernel declares at least the bytes it must move: the streams, the weights, the
    per-token mixing weights and its outputs (dsv4-plan counts a kernel by its declaration)."""
    hc, d, rows = 4, 4096, 24
    x, fn, w3 = S((b, s, hc, d), BF16), S((rows, hc * d), F32), S((3,), F32)
    collapse = aot.compile_for("v5p-8", jax.jit(lambda *a: hc_collapse(*a, impl="pallas", **EPS)),
                               x, fn, S((rows,), F32), w3)
    declared = [int(m.group(2)) for m in plan._DECLARED.finditer(collapse.compiled.as_text())]
    assert len(declared) == 1
    assert declared[0] >= b * s * (hc * d * 2 + d * 2 + rows * 4) + rows * hc * d * 4
    expand = aot.compile_for("v5p-8", jax.jit(lambda *a: hc_expand(*a, impl="pallas")),
                             S((b, s, d), BF16), x, S((b, s, hc), F32), S((b, s, hc, hc), F32))
    declared = [int(m.group(2)) for m in plan._DECLARED.finditer(expand.compiled.as_text())]
    assert len(declared) == 1
    assert declared[0] >= b * s * (d * 2 + 2 * hc * d * 2 + (hc + hc * hc) * 4)


@pytest.mark.parametrize("b, s", [(4, 1), (1, 512)])
def test_gpu_declared_cost_covers_the_streams(b, s):
    """The GPU kernels' declarations (carried in their op_names) cover what they must move: the
    collapse's two kernels read the streams once each, fn once, and write the collapsed streams
    and the mixes' partials; the expansion reads f and the streams and writes the streams."""
    hc, d, rows = 4, 4096, 24
    x, fn, w3 = S((b, s, hc, d), BF16), S((rows, hc * d), F32), S((3,), F32)
    collapse = aot.compile_for("h100x1", jax.jit(lambda *a: hc_collapse(*a, impl="pallas", **EPS)),
                               x, fn, S((rows,), F32), w3)
    assert aot.kernel_calls(collapse.compiled, "cuda") == [gpu.MIXES_NAME, gpu.SUM_NAME]
    declared = _gpu_declared(collapse.compiled.as_text())
    assert len(declared) == 2
    partials = hc * (d // gpu.MIXES_BK) * b * s * (rows + 1) * 4
    assert sum(declared) >= b * s * (2 * hc * d * 2 + d * 2) + rows * hc * d * 4 + partials
    expand = aot.compile_for("h100x1", jax.jit(lambda *a: hc_expand(*a, impl="pallas")),
                             S((b, s, d), BF16), x, S((b, s, hc), F32), S((b, s, hc, hc), F32))
    declared = _gpu_declared(expand.compiled.as_text())
    assert len(declared) == 1
    assert declared[0] >= b * s * (d * 2 + 2 * hc * d * 2 + (hc + hc * hc) * 4)


def _gpu_declared(text: str) -> list[int]:
    """The declared bytes of each kernel call in a compiled GPU program (from its op_name)."""
    return [int(plan.DECLARED_COST.search(line).group(2)) for line in text.splitlines()
            if "custom-call(" in line and plan.DECLARED_COST.search(line)]


# Flash's streams: a decode step of 8 rows and a 512-token prefill chunk, and an odd token count.
SHAPES = {"decode": (8, 1), "prefill": (1, 512), "prefill13": (1, 13)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("target", ["v5p-8", "v6e-8", "tpu7x-8"])
def test_kernels_compile_without_copying_the_streams(target, shape):
    """Both kernels compile for the TPU targets at Flash's shapes; the compiled program holds
    the kernel's call and no copy (re-layout) of the streams `[B, S, 4, 4096]`: they reach the
    kernel as they lie in HBM."""
    b, s = SHAPES[shape]
    x = S((b, s, 4, 4096), BF16)
    programs = {
        COLLAPSE_NAME: aot.compile_for(target, jax.jit(lambda *a: hc_collapse(*a, impl="pallas", **EPS)),
                                       x, S((24, 16384), F32), S((24,), F32), S((3,), F32)),
        EXPAND_NAME: aot.compile_for(target, jax.jit(lambda *a: hc_expand(*a, impl="pallas")),
                                     S((b, s, 4096), BF16), x, S((b, s, 4), F32), S((b, s, 4, 4), F32)),
    }
    for name, result in programs.items():
        assert aot.kernel_calls(result.compiled, "tpu") == [name]
        assert not _relayouts(result.compiled.as_text(), b * s * 4 * 4096 * 2)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("target", ["h100x1", "h200x8"])
def test_gpu_kernels_compile_without_fp32_streams(target, shape):
    """The GPU kernels compile for the H100 and H200 at Flash's shapes (Triton accepts them), and
    the compiled programs hold the kernels' calls and no other instruction making an array the
    size of the streams (a copy, or an fp32 version of them)."""
    b, s = SHAPES[shape]
    x = S((b, s, 4, 4096), BF16)
    programs = {
        (gpu.MIXES_NAME, gpu.SUM_NAME): aot.compile_for(
            target, jax.jit(lambda *a: hc_collapse(*a[:4], layer=a[4], impl="pallas", **EPS)),
            x, S((43, 24, 16384), F32), S((24,), F32), S((3,), F32), S((), jnp.int32)),
        (gpu.EXPAND_NAME,): aot.compile_for(target, jax.jit(lambda *a: hc_expand(*a, impl="pallas")),
                                            S((b, s, 4096), BF16), x, S((b, s, 4), F32), S((b, s, 4, 4), F32)),
    }
    for names, result in programs.items():
        assert aot.kernel_calls(result.compiled, "cuda") == list(names)
        text = result.compiled.as_text()
        big = [line.strip()[:160] for line in text.splitlines()
               if (m := re.match(r"\s+(?:ROOT )?%\S+ = (\w+\[[\d,]*\])\S* (?!parameter|custom-call|bitcast)", line))
               and plan._shape_bytes(m.group(1)) >= b * s * 4 * 4096 * 2]
        assert not big, big[:2]


def _relayouts(text: str, nbytes: int) -> list[str]:
    """The instructions of a compiled TPU program that copy an array of at least `nbytes` into
    another layout: a `copy`, or a `copy-start` whose destination's layout (a prefetch into
    VMEM, memory space S(1), aside) is not its source's."""
    found = []
    for line in text.splitlines():
        m = re.match(r"\s+(?:ROOT )?%[\w.\-]+ = \(?(\w+\[[\d,]*\])(\{[^}]*\}) (copy|copy-start)\(", line)
        if not m or plan._shape_bytes(m.group(1)) < nbytes:
            continue
        if m.group(3) == "copy":
            found.append(line.strip()[:200])
        else:
            src = re.findall(r"\[[\d,]*\](\{[^}]*\})", line)[1]
            if re.sub(r"S\(\d\)", "", m.group(2)) != re.sub(r"S\(\d\)", "", src):
                found.append(line.strip()[:200])
    return found


def test_collapse_reads_a_layer_of_the_stack_in_place():
    """With `layer`, fn is every layer's stack and the kernel reads that layer's in place: the
    interpreter's result is the reference's on the layer's fn, and the v5p program of a decode
    step's collapse, the layer traced, holds no instruction writing out a layer's fn."""
    x, fn, base, scale, *_ = _inputs(2, 3, 4, 128, 24, F32, seed=5)
    stack = jnp.stack([fn * 0.5, fn, -fn])
    run = jax.jit(lambda x, stack, base, scale, layer: hc_collapse(x, stack, base, scale, layer=layer,
                                                                   impl="pallas", **EPS))
    collapsed, m = run(x, stack, base, scale, jnp.int32(2))
    ref_collapsed, ref_m = hc_collapse_ref(x, -fn, base, scale, **EPS)
    _check(m, ref_m)
    _check(collapsed, ref_collapsed)

    result = aot.compile_for("v5p-8", run, S((8, 1, 4, 4096), BF16), S((43, 24, 16384), F32), S((24,), F32),
                             S((3,), F32), S((), jnp.int32))
    assert aot.kernel_calls(result.compiled, "tpu") == [COLLAPSE_NAME]
    written = _copies(result.compiled.as_text(), {("f32", "24,16384")})
    assert not written, written[:2]
