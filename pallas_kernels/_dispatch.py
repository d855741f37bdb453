"""Choosing between the Pallas kernels and the plain-JAX references.

`impl` is "pallas", "ref" or "auto". The choice of kernel is made per lowering platform with
`jax.lax.platform_dependent`, so a function jitted once lowers to the Mosaic TPU kernel for
"tpu", to the GPU kernel (Mosaic GPU or Pallas-Triton) for "cuda", and (for "pallas") to the
TPU kernel run by the Pallas interpreter anywhere else (CPU). "auto" uses the reference on
platforms without a kernel.

Also what the kernels share around their calls: the layer operand of the matmuls that read one
layer of a stack (`layer_operand`), and the GPU kernels' declared cost in their op_name
(`declared_cost_scope`).
"""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp

IMPLS = ("pallas", "ref", "auto")


def dispatch(impl: str, *, ref: Callable, tpu: Callable, gpu: Callable, interpret: Callable) -> Callable:
    """A function of the same operands that runs the implementation `impl` asks for."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "ref":
        return ref
    default = interpret if impl == "pallas" else ref

    def run(*args):
        return jax.lax.platform_dependent(*args, tpu=tpu, cuda=gpu, default=default)

    return run


def layer_operand(layer):
    """A kernel's layer index as its int32 `[1]` operand (the scalar its index maps or loads
    use): `layer`, or 0 for a weight that is one layer (passed as a stack of one)."""
    return jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))


def declared_cost_scope(cost):
    """A name scope that carries a GPU kernel's declared `pl.CostEstimate` into the compiled
    program, as `declared_cost_<flops>_<bytes>` in the kernel's op_name: jax's GPU lowerings
    drop the estimate (a TPU kernel's stays in its backend config), and dsv4-plan counts a
    kernel by it (`DECLARED_COST`)."""
    return jax.named_scope(f"declared_cost_{int(cost.flops)}_{int(cost.bytes_accessed)}")


DECLARED_COST = re.compile(r"declared_cost_(\d+)_(\d+)")
