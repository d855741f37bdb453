"""Choosing between the Pallas kernels and the plain-JAX references.

`impl` is "pallas", "ref" or "auto". The choice of kernel is made per lowering platform with
`jax.lax.platform_dependent`, so a function jitted once lowers to the Mosaic TPU kernel for
"tpu", to the Mosaic GPU kernel for "cuda", and (for "pallas") to the TPU kernel run by the
Pallas interpreter anywhere else (CPU). "auto" uses the reference on platforms without a kernel.
"""

from __future__ import annotations

from typing import Callable

import jax

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
