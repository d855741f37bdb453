"""`hc_collapse` and `hc_expand`: the hyper-connections' passes over the streams, with a choice of
implementation (see `_dispatch`). There is no GPU kernel: on H100 / H200 the prefill chunk is
compute-bound and decode bound by the weights (dsv4-plan), so XLA's fusions there are kept."""

from __future__ import annotations

import functools

from ._dispatch import dispatch
from .hyper_connection_ref import hc_collapse_ref, hc_expand_ref
from .hyper_connection_tpu import hc_collapse_tpu, hc_expand_tpu, supported


def hc_collapse(x, fn, base, scale, layer=None, *, hc_eps: float, norm_eps: float, impl: str = "auto"):
    """The semantics and arguments of `hc_collapse_ref` (fn an array), plus layer (fn then the
    stack `[L, R, hc * D]` of every layer's, of which the kernel reads layer `layer` in place; base
    and scale the layer's) and impl: "ref" (plain JAX), "pallas" (the Mosaic TPU kernel on TPU, the
    reference on CUDA, the TPU kernel in the Pallas interpreter elsewhere) or "auto" (the kernel on
    TPU, the reference elsewhere). D not a multiple of 128 takes the reference."""
    kw = dict(hc_eps=hc_eps, norm_eps=norm_eps)

    def ref(x, fn, base, scale, layer):
        return hc_collapse_ref(x, fn if layer is None else fn[layer], base, scale, **kw)

    if not supported(x.shape[-1]):
        impl = "ref"
    def kernel(x, fn, base, scale, layer, interpret=False):
        return hc_collapse_tpu(x, fn, base, scale, layer=layer, interpret=interpret, **kw)

    run = dispatch(impl, ref=ref, tpu=kernel, gpu=ref, interpret=functools.partial(kernel, interpret=True))
    return run(x, fn, base, scale, layer)


def hc_expand(f, x, post, comb, *, impl: str = "auto"):
    """The semantics and arguments of `hc_expand_ref`, plus impl as `hc_collapse`'s."""
    if not supported(x.shape[-1]):
        impl = "ref"
    run = dispatch(impl, ref=hc_expand_ref, tpu=hc_expand_tpu, gpu=hc_expand_ref,
                   interpret=functools.partial(hc_expand_tpu, interpret=True))
    return run(f, x, post, comb)
