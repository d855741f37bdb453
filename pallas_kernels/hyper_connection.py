"""`hc_collapse` and `hc_expand`: the hyper-connections' passes over the streams, with a choice of
implementation (see `_dispatch`): a Mosaic kernel on TPU, a Pallas-Triton kernel on CUDA."""

from __future__ import annotations

import functools

from ._dispatch import dispatch
from .hyper_connection_gpu import hc_collapse_gpu, hc_expand_gpu
from .hyper_connection_ref import hc_collapse_ref, hc_expand_ref
from .hyper_connection_tpu import hc_collapse_tpu, hc_expand_tpu, supported


def hc_collapse(x, fn, base, scale, layer=None, *, hc_eps: float, norm_eps: float, impl: str = "auto"):
    """The semantics and arguments of `hc_collapse_ref` (fn an array), plus layer (fn then the
    stack `[L, R, hc * D]` of every layer's, of which the kernel reads layer `layer` in place; base
    and scale the layer's) and impl: "ref" (plain JAX), "pallas" (the Mosaic kernel on TPU, the
    Pallas-Triton kernel on CUDA, the TPU kernel in the Pallas interpreter elsewhere) or "auto"
    (the kernels on TPU and CUDA, the reference elsewhere). On TPU and in the interpreter, D not a
    multiple of 128 takes the reference (the GPU kernel masks its tails)."""
    kw = dict(hc_eps=hc_eps, norm_eps=norm_eps)

    def ref(x, fn, base, scale, layer):
        return hc_collapse_ref(x, fn if layer is None else fn[layer], base, scale, **kw)

    def kernel(x, fn, base, scale, layer, interpret=False):
        return hc_collapse_tpu(x, fn, base, scale, layer=layer, interpret=interpret, **kw)

    def gpu(x, fn, base, scale, layer):
        return hc_collapse_gpu(x, fn, base, scale, layer=layer, **kw)

    tpu = kernel if supported(x.shape[-1]) else ref
    interpret = functools.partial(kernel, interpret=True) if tpu is kernel else ref
    run = dispatch(impl, ref=ref, tpu=tpu, gpu=gpu, interpret=interpret)
    return run(x, fn, base, scale, layer)


def hc_expand(f, x, post, comb, *, impl: str = "auto"):
    """The semantics and arguments of `hc_expand_ref`, plus impl as `hc_collapse`'s."""
    tpu = hc_expand_tpu if supported(x.shape[-1]) else hc_expand_ref
    interpret = functools.partial(hc_expand_tpu, interpret=True) if tpu is hc_expand_tpu else hc_expand_ref
    run = dispatch(impl, ref=hc_expand_ref, tpu=tpu, gpu=hc_expand_gpu, interpret=interpret)
    return run(f, x, post, comb)
