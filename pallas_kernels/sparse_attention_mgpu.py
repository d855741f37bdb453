"""Sparse-gather attention with a per-head sink: the Mosaic GPU kernel (Hopper, CUDA cores only).

Why no tensor cores: wgmma wants both operands in tiled + swizzled SMEM, and the gathered kv rows
arrive one by one (arbitrary rows), which a TMA into tiled SMEM refuses (slices must cover whole
8-row tiles). A re-layout through registers (plgpu.load with optimized=False, then a store into
swizzled SMEM) does export (mgpu_probe.py wgmma_unopt) but was found too late; see README.md, GPU
status. Decode is memory bound anyway (each gathered row serves only H = 64 or 128 heads), so
this kernel does all products on the CUDA cores, in fp32, out of plain (untiled, unswizzled) SMEM.

Heads come in groups of 64 (one WGMMA register tile). The wrapper pads H up to G = ceil(H / 64)
groups with zero q rows and a zero sink and slices the padded heads off the output, so every
H >= 1 runs the kernel: Flash (H = 64) is one group, Pro (H = 128) two, a small test model
(H = 2..16) one padded group.

Grid `(G * D // DV, B * T)`, one warpgroup (128 threads) per block; the token axis is the
minor one, so it maps to CUDA's x dimension (up to 2^31 - 1 blocks; y allows only 65535).
Block (gv, bt), with g = gv // (D / DV) and v = gv % (D / DV), handles token bt, heads
[64 g, 64 g + 64) and output columns [v * DV, (v + 1) * DV):
  * TMA once per block: the token's index row `[K_pad / 128, 128]` int32, the group's q
    `[64, D / BOX, BOX]` (a TMA box is at most 256 elements per dimension, so the D axis is viewed
    as D / BOX x BOX, BOX = 256 if it divides D, else 128) and the group's sink `[64]` f32.
  * For each block of BK keys: one TMA per *valid* key copies its kv row `[1, D / BOX, BOX]` into
    the plain SMEM buffer `[BK, D / BOX, BOX]` (a slot holding -1 only arrives on the barrier, with
    no copy). The barrier expects BK arrivals.
  * Logits `[64, BK]` over the full D, in chunks of 64 columns: a q chunk `[64, 64]` (WGMMA
    register layout, loaded from SMEM) times the row chunk broadcast along heads, reduced over the
    chunk. Every block recomputes all D of the logits (D / DV times redundant FMA work, same as the
    number of column blocks per token and group).
  * Online softmax per head in fp32. The running max starts at the sink and the running sum at 1,
    so the sink enters only the denominator and a row with no valid key gives exactly 0. Invalid
    slots get logit -inf (probability exactly 0).
  * acc `[64, DV]` f32 lives in registers (64 per thread at DV = 128): acc = alpha acc + sum_j p_j
    row_j[v-cols].
The output `[64, DV]` is stored straight from registers to GMEM in q's dtype. The G head groups
of a token gather the same rows (each group its own copies; they share them only through L2).

Supported: any H >= 1, D a multiple of 128 (DeepSeek-V4: D = 512), K up to MAX_K = 32768
(padded with -1 to a multiple of 128; the index row's TMA box has at most 256 rows of 128).
Falls back to the reference only for D not a multiple of 128 (the column blocks are 128 wide),
K > MAX_K, or H = 0; the fallback never raises, since the dispatcher traces this branch on every
platform.

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
HEADS = 64  # heads per group: WGMMA register layout rows (one warpgroup)
MAX_K = TMA_BOX * 128  # the index row is one TMA box [K_pad / 128, 128]

_TILE = plgpu.Layout.WGMMA  # [64, n] register tile
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [64]: one value per head
_COL = plgpu.Layout.WGMMA.reduce(0)  # [n]: one value per column, replicated over heads


def supported(h: int, d: int, k: int = 0) -> bool:
    return h >= 1 and d % DV == 0 and k <= MAX_K


def _box(d: int) -> int:  # elements per TMA box along D (the last dimension of the D view)
    return TMA_BOX if d % TMA_BOX == 0 else DV


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
            block_k: int, n_blocks: int, d: int, groups: int, lay: _Layouts):
    bt = lax.axis_index("bt")
    gv = lax.axis_index("gv")
    n_v = d // DV
    g = gv // n_v
    v = gv % n_v
    b = bt // t_len
    f32 = jnp.float32
    n_chunks = d // CHUNK
    box = _box(d)
    per_box = box // CHUNK
    qg = bt * groups + g  # row of the [B * T * G, 64, D / BOX, BOX] q view (and of the output)

    plgpu.copy_gmem_to_smem(idx_g.at[bt], idx_s, setup_bar)
    plgpu.copy_gmem_to_smem(q_g.at[qg], q_s, setup_bar)
    plgpu.copy_gmem_to_smem(sink_g.at[g], sink_s, setup_bar)
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
            rv = lay.load(buf, (j, col // box, pl.ds(col % box, DV)), _COL).astype(f32)
            # An invalid slot's buffer row is stale or uninitialised SMEM (possibly NaN / inf):
            # p_j = 0 is not enough, the row itself must be zeroed.
            rv = jnp.where(row_of(j) >= 0, rv, 0.0)
            return acc + _rows(p_j, DV) * _cols(rv, DV)

        acc = lax.fori_loop(0, block_k, pv, _rows(alpha, DV) * acc)
        return m_new, l, acc

    _, l, acc = lax.fori_loop(0, n_blocks, key_block, (m0, l0, acc0))
    out = (acc / _rows(l, DV)).astype(o_g.dtype)
    o_g[qg, :, pl.ds(v * DV, DV)] = out


def sparse_attention_mgpu(q, kv, indices, sink, *, scale: float, interpret=None, block_k: int = BLOCK_K):
    """Same contract as `sparse_attention_ref`; the Mosaic GPU kernel for any H (in groups of 64
    heads, padded) and D a multiple of 128 (DeepSeek-V4: H = 64 or 128, D = 512), the reference
    otherwise. interpret: None, or a GPU-interpret params object (`InterpretGPUParams`: runs the
    kernel on CPU)."""
    bsz, t_len, h, d = q.shape
    n = kv.shape[1]
    k = indices.shape[-1]
    if not supported(h, d, k):
        # D not a multiple of 128 (the output column blocks are 128 wide), K > MAX_K or H = 0 use
        # the reference; the dispatcher traces this branch on every platform, so it must not raise.
        return sparse_attention_ref(q, kv, indices, sink, scale=scale)
    if block_k % 8 or 128 % block_k:  # [64, BK] register tiles have 8-column tiles; BK | K_pad
        raise ValueError(f"block_k must be a multiple of 8 dividing 128, got {block_k}")
    k_pad = pl.cdiv(k, 128) * 128  # the index row is TMA'd as [K_pad / 128, 128]
    idx = indices.astype(jnp.int32)
    if k_pad != k:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, k_pad - k)), constant_values=-1)
    groups = pl.cdiv(h, HEADS)
    h_pad = groups * HEADS
    sink = sink.astype(jnp.float32)
    if h_pad != h:  # padded heads: zero q rows and sink, sliced off the output below
        q = jnp.pad(q, ((0, 0), (0, 0), (0, h_pad - h), (0, 0)))
        sink = jnp.pad(sink, (0, h_pad - h))
    bt = bsz * t_len
    box = _box(d)
    boxes = d // box
    kernel = functools.partial(_kernel, scale=float(scale), t_len=t_len, block_k=block_k,
                               n_blocks=k_pad // block_k, d=d, groups=groups, lay=_Layouts(interpret is not None))
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((bt * groups, HEADS, d), q.dtype),
        grid=(groups * (d // DV), bt),
        grid_names=("gv", "bt"),
        scratch_types=[
            plgpu.SMEM((k_pad // 128, 128), jnp.int32),
            plgpu.SMEM((HEADS, boxes, box), q.dtype),
            plgpu.SMEM((HEADS,), jnp.float32),
            plgpu.SMEM((block_k, boxes, box), kv.dtype),
            plgpu.Barrier(num_arrivals=3),  # idx, q, sink
            plgpu.Barrier(num_arrivals=block_k),  # one arrival per key slot (copy or not)
        ],
        interpret=interpret,
        kernel_name="dsv4_sparse_attention",
    )(q.reshape(bt * groups, HEADS, boxes, box), kv.reshape(bsz, n, boxes, box), idx.reshape(bt, k_pad // 128, 128),
      sink.reshape(groups, HEADS))
    out = out.reshape(bsz, t_len, h_pad, d)
    return out[:, :, :h] if h_pad != h else out
