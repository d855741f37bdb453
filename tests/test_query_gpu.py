"""`query_norm_rope_gpu` (the Pallas-Triton kernel that makes the attention's queries ready on
CUDA: per-head RMS norm, then the rotation): its body in the Pallas interpreter against the
plain-JAX ops it replaces, its declared cost, and its H100 compile (sm_90a, XLA's Triton;
dsv4_jax.tools.aot, the `aot` extra). Nothing here runs on a GPU.

Tolerances: the kernel computes what `rotate_heads(unweighted_rms_norm(q))` computes, op for op
(the statistic in fp32, the factor and the product rounded to q's dtype, the rotation in fp32);
only the order of the statistic's sum differs. bf16: equal (a last-bit difference in the
statistic rarely moves the bf16 factor; none does on these inputs). fp32: within 1e-6 of max |q|.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.tools import aot
from pallas_kernels import query_gpu
from pallas_kernels.numerics import rotate_heads, unweighted_rms_norm

S = jax.ShapeDtypeStruct


def _inputs(b, t, h, d, half, dtype, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d)) * rng.uniform(0.05, 40, (b, t, h, 1))  # heads of any scale
    angle = rng.uniform(-np.pi, np.pi, (b, t, half))
    return jnp.asarray(q, dtype), (jnp.asarray(np.cos(angle), jnp.float32), jnp.asarray(np.sin(angle), jnp.float32))


# (B, T, H, D, rope / 2, dtype): Flash's heads (512, rope 64) at a decode step; rows that leave
# the last program partial (3 x 5 x 3 = 45 rows, 16 a program); D off a power of two with a
# rope half off one (masked columns and pairs); fp32.
CASES = {
    "flash-decode-bf16": (2, 1, 64, 512, 32, jnp.bfloat16),
    "partial-rows-bf16": (3, 5, 3, 128, 32, jnp.bfloat16),
    "d96-rope6-bf16": (1, 4, 5, 96, 3, jnp.bfloat16),
    "fp32": (2, 3, 8, 128, 16, jnp.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_query_norm_rope_gpu_matches_the_ops(case):
    b, t, h, d, half, dtype = CASES[case]
    q, rope = _inputs(b, t, h, d, half, dtype, seed=d + t)
    out = query_gpu.query_norm_rope_gpu(q, rope, eps=1e-6, interpret=True)
    want = rotate_heads(unweighted_rms_norm(q, 1e-6), rope)
    assert out.shape == q.shape and out.dtype == q.dtype
    out, want = (np.asarray(x, np.float32) for x in (out, want))
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(out, want)
    else:
        assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max()
    # the rotation and the norm both matter on these inputs
    assert np.abs(out - np.asarray(unweighted_rms_norm(q, 1e-6), np.float32)).max() > 0.1
    assert np.abs(out - np.asarray(rotate_heads(q, rope), np.float32)).max() > 1.0


def test_query_norm_rope_gpu_declared_cost():
    """Each row of q read and written once, each token's cos and sin read once."""
    b, t, h, d = 1, 512, 64, 512
    q, rope = S((b, t, h, d), jnp.bfloat16), (S((b, t, 32), jnp.float32),) * 2
    eqns = [e for e in jax.make_jaxpr(lambda q, c, s: query_gpu.query_norm_rope_gpu(q, (c, s), eps=1e-6))(
        q, *rope).eqns if e.primitive.name == "pallas_call"]
    assert len(eqns) == 1
    assert eqns[0].params["cost_estimate"].bytes_accessed == 2 * b * t * h * d * 2 + 2 * b * t * 32 * 4


@pytest.mark.parametrize("t", [1, 512], ids=["decode", "prefill"])
def test_query_norm_rope_gpu_compiles_for_h100(t):
    """Flash's queries (64 heads of 512, rope 64) for an H100: the kernel alone in the program,
    and no op of XLA's making an array of q's size (a copy of the queries). (Its registers and
    spills: the kernel report's `query_norm_rope` cases, tests/test_aot_report.py.)"""
    q, rope = S((1, t, 64, 512), jnp.bfloat16), (S((1, t, 32), jnp.float32),) * 2
    fn = jax.jit(lambda q, c, s: query_gpu.query_norm_rope_gpu(q, (c, s), eps=1e-6))
    result = aot.compile_for("h100x1", fn, q, *rope)
    assert aot.kernel_calls(result.compiled, "cuda") == [query_gpu.NAME]
    sizes = {f"{t * 64},512", f"1,{t},64,512"}
    instructions = [line for line in result.compiled.as_text().splitlines() if re.match(r"\s+(ROOT )?%\S+ = ", line)]
    copies = [line for line in instructions if " parameter(" not in line and "custom-call(" not in line
              and " bitcast(" not in line and any(f"[{s}]" in line.split(" = ")[1].split(" ")[0] for s in sizes)]
    assert not copies, copies
