"""`grouped_matmul`: rows sorted by expert times their experts' weights (the routed experts'
matmul), the weights kept as stored (plain, FP8 or FP4), with a choice of implementation (see
`_dispatch`); `grouped_swiglu`: the routed experts' two first products and their activation;
`block_diagonal_matmul`: x's column blocks times a weight's blocks (the grouped output
projection)."""

from __future__ import annotations

import jax.numpy as jnp

from ._dispatch import dispatch
from .grouped_matmul_gpu import block_diagonal_matmul_gpu, grouped_matmul_gpu, grouped_swiglu_gpu
from .grouped_matmul_ref import grouped_matmul_ref, grouped_swiglu_ref
from .grouped_matmul_tpu import (block_diagonal_matmul_tpu, block_diagonal_supported, grouped_matmul_tpu,
                                 grouped_swiglu_tpu)
from .numerics import rotate_row_heads


def _stored(w):
    """(values, scale, fmt) of a weight: a QuantizedWeight's, or a plain array's."""
    return (w.values, w.scale, w.fmt) if hasattr(w, "fmt") else (w, None, None)


def _rows(x):
    """x `[M, K]`, or in pieces `[M, P, K/P]`, as `[M, K]`."""
    return x.reshape(x.shape[0], -1)


def _check(name: str, x, w, group_sizes, layer):
    lead = 2 if layer is not None else 1
    if (x.ndim not in (2, 3) or len(w.shape) != lead + 2 or w.shape[-1] != _rows(x).shape[1]
            or group_sizes.shape != (w.shape[lead - 1],)):
        stack = "[L, E, N, K]" if layer is not None else "[E, N, K]"
        raise ValueError(f"{name}: x {tuple(x.shape)}, a weight {list(w.shape)} and group_sizes "
                         f"{tuple(group_sizes.shape)} (needs x [M, K] or [M, P, K/P], w {stack}, group_sizes [E])")


def grouped_matmul(x, w, group_sizes, *, layer=None, out_pieces: int = 1, impl: str = "auto"):
    """x `[M, K]` (bf16 or fp32) times each group's expert of w transposed: `[M, N]` in x's
    dtype, products accumulated in fp32, rows past sum(group_sizes) zero.

    x's rows are sorted by expert: group g (group_sizes[g] rows, int32 `[E]`, sum <= M, not
    checked) follows group g - 1. w: `[E, N, K]`, a plain array (bf16, fp32) or a
    `QuantizedWeight` (FP8 or FP4, as stored; dequantized as `QuantizedWeight.dequantize`
    does, to x's dtype); with `layer` (int scalar, may be traced) the stack `[L, E, N, K]` of
    every layer, of which layer `layer` is used without slicing it out first.
    x may come in pieces `[M, P, K/P]`, and with out_pieces Q the output goes as `[M, Q, N/Q]`:
    each row in pieces, the layout in which XLA moves 16-bit rows through a ragged all-to-all on
    TPU, which the TPU kernel reads and writes in place (`grouped_matmul_tpu`); a reshape of
    whole rows elsewhere.
    impl: "ref" (`grouped_matmul_ref`: dequantize, then a ragged product), "pallas" (the Mosaic
    TPU kernel on TPU, the Pallas-Triton kernel `grouped_matmul_gpu` on CUDA, and the TPU
    kernel in the Pallas interpreter elsewhere) or "auto" (the kernels on TPU and CUDA, the
    reference elsewhere)."""
    _check("grouped_matmul", x, w, group_sizes, layer)
    n = w.shape[-2]
    if out_pieces < 1 or n % out_pieces:
        raise ValueError(f"grouped_matmul: out_pieces {out_pieces} does not divide the output's width {n}")
    values, scale, fmt = _stored(w)

    def in_pieces(y):  # `[M, N]` -> the output's shape
        return y.reshape(y.shape[0], out_pieces, -1) if out_pieces > 1 else y

    def kernel(interpret):
        return lambda x, g, *l: grouped_matmul_tpu(x, values, g, fmt=fmt, scale=scale, layer=l[0] if l else None,
                                                   interpret=interpret, out_pieces=out_pieces)

    def gpu(x, g, *l):
        return in_pieces(grouped_matmul_gpu(_rows(x), values, g, fmt=fmt, scale=scale, layer=l[0] if l else None))

    def ref(x, g, *l):
        return in_pieces(grouped_matmul_ref(_rows(x), w, g, layer=l[0] if l else None))

    run = dispatch(impl, ref=ref, tpu=kernel(False), gpu=gpu, interpret=kernel(True))
    return run(x, group_sizes, *(() if layer is None else (layer,)))


def grouped_swiglu(x, w1, w3, group_sizes, hw, *, limit: float, layer=None, impl: str = "auto"):
    """The routed experts' first half: `swiglu(grouped_matmul(x, w1), grouped_matmul(x, w3),
    limit) * hw` rounded to x's dtype (`grouped_swiglu_ref`), `[M, N]`, rows past
    sum(group_sizes) zero. x (`[M, K]` or in pieces), group_sizes, layer as `grouped_matmul`
    takes them; w1 and w3 alike
    in format and shape `[E, N, K]` (or `[L, E, N, K]`); hw fp32 `[M]`, the rows' routing weights
    (past the groups not read: may be unset).

    impl as `grouped_matmul`'s: one kernel, in which neither product goes through HBM, on CUDA
    (Pallas-Triton, `grouped_swiglu_gpu`) and on TPU (Mosaic, `grouped_swiglu_tpu`; in the
    interpreter elsewhere); "ref" the plain-JAX reference."""
    for w in (w1, w3):
        _check("grouped_swiglu", x, w, group_sizes, layer)
    (v1, s1, fmt), (v3, s3, fmt3) = _stored(w1), _stored(w3)
    if fmt != fmt3 or w1.shape != w3.shape or hw.shape != x.shape[:1]:
        raise ValueError(f"grouped_swiglu: w1 ({fmt or 'plain'} {list(w1.shape)}) and w3 ({fmt3 or 'plain'} "
                         f"{list(w3.shape)}) must be alike, hw {tuple(hw.shape)} must be [M] for x {tuple(x.shape)}")

    def ref(x, g, hw, *l):
        return grouped_swiglu_ref(_rows(x), w1, w3, g, hw, limit=limit, layer=l[0] if l else None)

    def kernel(interpret):
        return lambda x, g, hw, *l: grouped_swiglu_tpu(x, (v1, s1), (v3, s3), g, hw, fmt=fmt, limit=limit,
                                                       layer=l[0] if l else None, interpret=interpret)

    def gpu(x, g, hw, *l):
        return grouped_swiglu_gpu(_rows(x), (v1, s1), (v3, s3), g, hw, fmt=fmt, limit=limit,
                                  layer=l[0] if l else None)

    run = dispatch(impl, ref=ref, tpu=kernel(False), gpu=gpu, interpret=kernel(True))
    return run(x, group_sizes, hw, *(() if layer is None else (layer,)))


def block_diagonal_matmul(x, w, *, layer=None, x_rope=None, head_dim: int | None = None, impl: str = "auto"):
    """x `[M, E*K]` times the block-diagonal weight of w's E blocks `[E, N, K]` (plain or a
    `QuantizedWeight`, as `grouped_matmul` takes it; with `layer` the stack `[L, E, N, K]`):
    `[M, E*N]` in x's dtype, x's columns g K .. (g + 1) K - 1 times block g transposed into the
    output's columns g N .. (g + 1) N - 1, products accumulated in fp32.

    With x_rope = (cos, sin) fp32 `[M, r/2]`: x's columns are heads of head_dim values whose last
    r are rotated at each row's angle (the attention's output at its queries' rotation, as
    `rotate_heads` leaves a head), and they are rotated back first, rounded to x's dtype
    (`rotate_heads(..., inverse=True)`).

    It is `grouped_matmul` of E groups of M rows. The kernels read each group's rows in place in
    x's column block and write them into the output's, rotating x's RoPE dims as they load them
    (on CUDA `block_diagonal_matmul_gpu`; on TPU, and in the interpreter elsewhere,
    `block_diagonal_matmul_tpu` where its blocks are whole lanes). Otherwise, and by "ref": x
    rotated back and its column blocks re-laid out as groups of rows, and the output back."""
    lead = 2 if layer is not None else 1
    if x.ndim != 2 or len(w.shape) != lead + 2 or x.shape[1] != w.shape[lead - 1] * w.shape[-1]:
        stack = "[L, E, N, K]" if layer is not None else "[E, N, K]"
        raise ValueError(f"block_diagonal_matmul: x {tuple(x.shape)} and a weight {list(w.shape)} (needs x "
                         f"[M, E*K], w {stack})")
    e, m = w.shape[lead - 1], x.shape[0]
    if x_rope is not None and (head_dim is None or head_dim % 2 or w.shape[-1] % head_dim
                               or any(a.shape != (m, x_rope[0].shape[-1]) for a in x_rope)
                               or 2 * x_rope[0].shape[-1] > head_dim):
        raise ValueError(f"block_diagonal_matmul: x_rope {[tuple(a.shape) for a in x_rope]} for x {tuple(x.shape)} "
                         f"in heads of head_dim {head_dim} (needs cos, sin [M, r/2], r <= head_dim, heads whole "
                         "in a block)")
    values, scale, fmt = _stored(w)

    def as_groups(x, cs, l):  # cs: x_rope or None; l: layer or None
        if cs is not None:
            x = rotate_row_heads(x, cs, head_dim, inverse=True)
        rows = jnp.swapaxes(x.reshape(m, e, -1), 0, 1).reshape(e * m, -1)
        z = grouped_matmul(rows, w, jnp.full((e,), m, jnp.int32), layer=l, impl=impl)
        return jnp.swapaxes(z.reshape(e, m, -1), 0, 1).reshape(m, -1)

    def tpu_kernel(interpret):
        if not block_diagonal_supported(w.shape[-1], w.shape[-2], fmt, None if x_rope is None else head_dim):
            return as_groups
        return lambda x, cs, l: block_diagonal_matmul_tpu(x, values, fmt=fmt, scale=scale, layer=l, x_rope=cs,
                                                          head_dim=head_dim, interpret=interpret)

    def gpu(x, cs, l):
        return block_diagonal_matmul_gpu(x, values, fmt=fmt, scale=scale, layer=l, x_rope=cs, head_dim=head_dim)

    run = dispatch(impl, ref=as_groups, tpu=tpu_kernel(False), gpu=gpu, interpret=tpu_kernel(True))
    return run(x, None if x_rope is None else tuple(x_rope), layer)
