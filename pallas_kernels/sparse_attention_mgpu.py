"""Sparse-gather attention with a per-head sink: the Mosaic GPU kernel (Hopper, CUDA cores only).

Why no tensor cores: wgmma wants both operands in tiled + swizzled SMEM, and the gathered kv rows
arrive one by one (arbitrary rows), which a TMA into tiled SMEM refuses (slices must cover whole
8-row tiles). A re-layout through registers (plgpu.load with optimized=False, then a store into
swizzled SMEM) does export (mgpu_probe.py wgmma_unopt) but was found too late; see README.md, GPU
status. Decode at H = 64 is memory bound anyway (each gathered row serves only 64 heads), so this
kernel does all products on the CUDA cores, in fp32, out of plain (untiled, unswizzled) SMEM.

Grid `(B * T, D // DV)`, one warpgroup (128 threads) per block. Block (bt, v) handles token bt,
all H = 64 heads, and output columns [v * DV, (v + 1) * DV):
  * TMA once per block: the token's index row `[K_pad / 128, 128]` int32, q `[H, D / 256, 256]`
    (a TMA box is at most 256 elements per dimension, so the D axis is viewed as D / 256 x 256)
    and the sink `[H]` f32.
  * For each block of BK keys: one TMA per *valid* key copies its kv row `[1, D / 256, 256]` into
    the plain SMEM buffer `[BK, D / 256, 256]` (a slot holding -1 only arrives on the barrier, with
    no copy). The barrier expects BK arrivals.
  * Logits `[H, BK]` over the full D, in chunks of 64 columns: a q chunk `[H, 64]` (WGMMA register
    layout, loaded from SMEM) times the row chunk broadcast along heads, reduced over the chunk.
    Every block recomputes all D of the logits (D / DV times redundant FMA work, same as the number
    of blocks per token).
  * Online softmax per head in fp32. The running max starts at the sink and the running sum at 1,
    so the sink enters only the denominator and a row with no valid key gives exactly 0. Invalid
    slots get logit -inf (probability exactly 0).
  * acc `[H, DV]` f32 lives in registers (64 per thread at DV = 128): acc = alpha acc + sum_j p_j
    row_j[v-cols].
The output `[H, DV]` is stored straight from registers to GMEM in q's dtype.

Numerics match sparse_attention_ref up to fp32 summation order (products in fp32 of the stored
q / kv values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .sparse_attention_ref import sparse_attention_ref

HAVE_KERNEL = True

BLOCK_K = 16  # keys per TMA batch / softmax update
DV = 128  # output columns per block: acc [64, 128] f32 = 64 registers per thread
CHUNK = 64  # columns per register tile for the logits
TMA_BOX = 256  # max elements per dimension of one TMA copy
HEADS = 64  # WGMMA register layout rows (one warpgroup)

_TILE = plgpu.Layout.WGMMA  # [64, n] register tile
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [64]: one value per head
_COL = plgpu.Layout.WGMMA.reduce(0)  # [n]: one value per column, replicated over heads


def supported(h: int, d: int) -> bool:
    return h == HEADS and d % TMA_BOX == 0


class _Layouts:
    """Register-layout annotations. The GPU interpreter (CPU) supports neither plgpu.load nor
    layout_cast (it ignores layouts altogether), so interpreted kernels use plain ref reads and
    no casts; the compiled kernel is otherwise the same trace."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def load(self, ref, idx, layout):
        # Plain SMEM into a register layout. optimized=False: there is no bank-conflict-free
        # plan for an untiled source; conflicts cost SMEM bandwidth only.
        return ref[idx] if self.interpret else plgpu.load(ref, idx, layout=layout, optimized=False)

    def iota(self, shape, dim, layout):
        return lax.broadcasted_iota(jnp.int32, shape, dim) if self.interpret else \
            plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)


def _rows(x, n):  # [64] per head -> [64, n]
    return lax.broadcast_in_dim(x, (HEADS, n), (0,))


def _cols(x, n):  # [n] per column -> [64, n]
    return lax.broadcast_in_dim(x, (HEADS, n), (1,))


def _kernel(q_g, kv_g, idx_g, sink_g, o_g, idx_s, q_s, sink_s, buf, setup_bar, row_bar, *, scale: float, t_len: int,
            block_k: int, n_blocks: int, d: int, lay: _Layouts):
    bt = lax.axis_index("bt")
    v = lax.axis_index("v")
    b = bt // t_len
    f32 = jnp.float32
    n_chunks = d // CHUNK
    per_box = TMA_BOX // CHUNK

    plgpu.copy_gmem_to_smem(idx_g.at[bt], idx_s, setup_bar)
    plgpu.copy_gmem_to_smem(q_g.at[bt], q_s, setup_bar)
    plgpu.copy_gmem_to_smem(sink_g, sink_s, setup_bar)
    plgpu.barrier_wait(setup_bar)

    col_iota = lay.iota((HEADS, block_k), 1, _TILE)
    m0 = lay.cast(sink_s[...], _ROW)
    l0 = lay.cast(jnp.ones((HEADS,), f32), _ROW)
    acc0 = lay.cast(jnp.zeros((HEADS, DV), f32), _TILE)

    def key_block(kb, carry):
        m, l, acc = carry
        base = kb * block_k
        row_of = lambda j: idx_s[(base + j) // 128, (base + j) % 128]

        def fetch(j, c):
            row = row_of(j)

            @pl.when(row >= 0)
            def _():
                plgpu.copy_gmem_to_smem(kv_g.at[b, pl.ds(row, 1)], buf.at[pl.ds(j, 1)], row_bar)

            @pl.when(row < 0)
            def _():
                plgpu.barrier_arrive(row_bar)

            return c

        lax.fori_loop(0, block_k, fetch, 0)
        plgpu.barrier_wait(row_bar)

        # Logits [H, BK]: key j's column is filled in by a select on the column iota.
        def logit(j, s):
            def chunk(c, acc_j):
                cols = pl.ds((c % per_box) * CHUNK, CHUNK)
                qc = lay.load(q_s, (slice(None), c // per_box, cols), _TILE)
                rc = lay.load(buf, (j, c // per_box, cols), _COL)
                prod = qc.astype(f32) * _cols(rc.astype(f32), CHUNK)
                return acc_j + jnp.sum(prod, axis=1)

            s_j = lax.fori_loop(0, n_chunks, chunk, lay.cast(jnp.zeros((HEADS,), f32), _ROW))
            s_j = jnp.where(row_of(j) >= 0, s_j * scale, -jnp.inf)
            return jnp.where(col_iota == j, _rows(s_j, block_k), s)

        s = lax.fori_loop(0, block_k, logit, lay.cast(jnp.full((HEADS, block_k), -jnp.inf, f32), _TILE))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - _rows(m_new, block_k))
        l = alpha * l + jnp.sum(p, axis=1)

        def pv(j, acc):
            p_j = jnp.sum(jnp.where(col_iota == j, p, 0.0), axis=1)
            col = v * DV
            rv = lay.load(buf, (j, col // TMA_BOX, pl.ds(col % TMA_BOX, DV)), _COL).astype(f32)
            # An invalid slot's buffer row is stale or uninitialised SMEM (possibly NaN / inf):
            # p_j = 0 is not enough, the row itself must be zeroed.
            rv = jnp.where(row_of(j) >= 0, rv, 0.0)
            return acc + _rows(p_j, DV) * _cols(rv, DV)

        acc = lax.fori_loop(0, block_k, pv, _rows(alpha, DV) * acc)
        return m_new, l, acc

    _, l, acc = lax.fori_loop(0, n_blocks, key_block, (m0, l0, acc0))
    out = (acc / _rows(l, DV)).astype(o_g.dtype)
    o_g[bt, :, pl.ds(v * DV, DV)] = out


def sparse_attention_mgpu(q, kv, indices, sink, *, scale: float, interpret=None, block_k: int = BLOCK_K):
    """Same contract as `sparse_attention_ref`; the Mosaic GPU kernel for H = 64 and D a multiple of
    256 (DeepSeek-V4: H = 64, D = 512), the reference otherwise. interpret: None, or a
    GPU-interpret params object (`InterpretGPUParams`: runs the kernel on CPU)."""
    bsz, t_len, h, d = q.shape
    n = kv.shape[1]
    k = indices.shape[-1]
    if not supported(h, d):
        # Shapes outside the kernel's register tiling (H != 64, D not a multiple of 256) use the
        # reference; the dispatcher traces this branch on every platform, so it must not raise.
        return sparse_attention_ref(q, kv, indices, sink, scale=scale)
    if block_k % 8 or 128 % block_k:  # [64, BK] register tiles have 8-column tiles; BK | K_pad
        raise ValueError(f"block_k must be a multiple of 8 dividing 128, got {block_k}")
    k_pad = pl.cdiv(k, 128) * 128  # the index row is TMA'd as [K_pad / 128, 128]
    idx = indices.astype(jnp.int32)
    if k_pad != k:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, k_pad - k)), constant_values=-1)
    bt = bsz * t_len
    boxes = d // TMA_BOX
    kernel = functools.partial(_kernel, scale=float(scale), t_len=t_len, block_k=block_k,
                               n_blocks=k_pad // block_k, d=d, lay=_Layouts(interpret is not None))
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((bt, h, d), q.dtype),
        grid=(bt, d // DV),
        grid_names=("bt", "v"),
        scratch_types=[
            plgpu.SMEM((k_pad // 128, 128), jnp.int32),
            plgpu.SMEM((h, boxes, TMA_BOX), q.dtype),
            plgpu.SMEM((h,), jnp.float32),
            plgpu.SMEM((block_k, boxes, TMA_BOX), kv.dtype),
            plgpu.Barrier(num_arrivals=3),  # idx, q, sink
            plgpu.Barrier(num_arrivals=block_k),  # one arrival per key slot (copy or not)
        ],
        interpret=interpret,
        kernel_name="dsv4_sparse_attention",
    )(q.reshape(bt, h, boxes, TMA_BOX), kv.reshape(bsz, n, boxes, TMA_BOX), idx.reshape(bt, k_pad // 128, 128),
      sink.astype(jnp.float32))
    return out.reshape(bsz, t_len, h, d)
