"""Decode state, grouped per layer kind like the parameters, with static shapes.

Every row (sequence) has its own position, and everything of it is addressed by position: the
window's K=V rows and the compressors' projections in per-row rings (position s in slot s %
size), the compressed entries in paged pools. `lookahead` (default 0) widens the rings by the
positions a step may write beyond those it keeps (speculative decoding: drafts that a
verification rejects); a row's position then simply stays before them, and they are overwritten
later, before anything reads those slots.

The pools are shared by the rows and cut into blocks of `block_size` tokens (a multiple of every
compress ratio the model has): a block holds block_size / ratio entries of each compressed kind,
and logical block j of row b (its positions j * block_size ..) is physical block `blocks[b, j]`
of every pool. A row's entry e is then row `e % E` of block `blocks[b, e // E]` (E = entries a
block holds). `init_cache` gives each row its own blocks (row b: b * nb .. (b + 1) * nb - 1);
the engine hands blocks out as sequences grow (dsv4_jax/runtime/engine.py).

    pos            int32 [B]                tokens already in each row
    blocks         int32 [B, nb]            block table: the physical block of each logical one
                                            (a model with compressed layers only)
    shared         int32 [B]                positions before it sit in blocks shared with other rows
                                            (prefix caching): their entries are read from the pools,
                                            never computed into them (with the table)
    folded         int32 [B]                the compressors' folded state rows end here
                                            (attention.compress_chunk)
    window (window-only layers, n of them):
      ring         [n, B, W + la, Dh]           sliding-window K=V rows (fp8: record words, below)
    csa (ratio-4 layers):
      ring         [n, B, W + la, Dh]
      pool         [n, NB, block_size / 4, Dh]  compressed entries
      state_a/z    [n, B, 2 + la, 2 Dh]  fp32   the compressor's projections (z with `ape`): the
                                                block before the open one folded into one row, the
                                                open block's positions before `folded` into one,
                                                then a ring of the positions after it
                                                (attention.compress_chunk)
    indexer (ratio-4 layers that run their indexer's compressor: all of them, or only those that
             compute their top-k under IndexCache with index_cache_skip_compressor):
      pool         [n, NB, block_size / 4, dI]  the indexer's keys (fp8: record words, below)
      state_a/z    [n, B, 2 + la, 2 dI]  fp32
    hca (ratio-128 layers):
      ring         [n, B, W + la, Dh]
      pool         [n, NB, block_size / 128, Dh]
      state_a/z    [n, B, 1 + la, Dh]  fp32     the open block's positions before `folded` folded
                                                into one row, then a ring of the positions after it

With kv_cache_dtype "fp8" the ratio-4 and ratio-128 pools hold each entry, and every window
ring (the MTP block's too) each K=V row, as DeepSeek's FP8 record (pallas_kernels/kv_record.py:
e4m3 NoPE values with a power-of-two scale per 64, bf16 RoPE values; 584 bytes for head_dim 512)
in 32-bit words, uint32 `[n, NB, E, record bytes / 4]` and `[n, B, W + la, record bytes / 4]`
(kv_record.to_words: the same bytes); the model encodes an entry or a K=V row when it computes
it, and attends to the records (the attention kernels decode the rows they gather). The rings hold records as the pools
do because DeepSeek's reference FP8-simulates every K=V row (the window's as the compressed
entries: act_quant on the NoPE values, blocks of 64, UE8M0 scales; architecture.md §5.2) and the
serving engines (vLLM, FlashMLA) store the sliding-window cache in the same record (§11.4). The
indexer's keys are records too, with no RoPE part (the Hadamard rotation mixes every dim): 128
e4m3 values with a power-of-two scale per 64, 136 bytes a key against 256 in bf16 (the serving
engines keep them in FP8 as well, §11.4: 128 e4m3 bytes and one fp32 scale).

A row reads only slots and entries of positions below its own that it wrote itself (positions
before 0 count as missing: a block before the first gets softmax weight 0), so a row is reset by
setting its position to 0 (`reset_rows`, which restarts its fold point with it), and slots and entries past a position hold
don't-cares (finite: every pool starts at zero and only ever holds computed entries).

A row can also start at a position p > 0 over blocks another row computed (prefix caching): its
table names the shared blocks, `shared` the position they end at, and its rings and compressor
states hold another sequence's don't-cares. Running the `recompute_span` tokens before `shared`
again makes every layer's window and compressor state at `shared` what a run from position 0
gives (the don't-cares reach only outputs that no later position reads). Or the row starts from
a snapshot: a row's state (`row_state`: everything of it but its table and reuse point) saved
when it was at that position (`save_rows`) and put back into another row (`restore_rows`), the
position addressing of the rings making it valid in any row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from pallas_kernels.kv_record import record_bytes
from .layer_kinds import COMPRESSED, CSA, KINDS

KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the compute dtype
ROW_LEAVES = (("pos",), ("blocks",), ("shared",), ("folded",))  # a row's own leaves outside the kinds' stacks


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raises ValueError unless kv_cache_dtype is one of KV_CACHE_DTYPES."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype {kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")


def _compress_ratios(cfg: ModelConfig) -> list[int]:
    """The compress ratios cfg's layers use (none for a window-only model: no pools)."""
    return sorted(k.ratio for k in COMPRESSED if cfg.layers_of_ratio(k.ratio))


def default_block_size(cfg: ModelConfig) -> int:
    """The smallest block every compress ratio of cfg divides (1 for a window-only model)."""
    return math.lcm(1, *_compress_ratios(cfg))


def check_block_size(cfg: ModelConfig, block_size: int) -> None:
    """Raises ValueError unless every compress ratio of cfg divides block_size."""
    unit = default_block_size(cfg)
    if block_size < 1 or block_size % unit:
        raise ValueError(f"block size {block_size} must be a positive multiple of {unit} (every compress ratio "
                         f"of the model, {_compress_ratios(cfg)}, "
                         f"must divide it)")


def blocks_per_row(max_len: int, block_size: int) -> int:
    """Blocks a row of up to max_len tokens needs (at least one, so every pool has a block to
    gather from)."""
    return max(1, -(-max_len // block_size))


def indexer_state_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Ids of the ratio-4 layers that keep indexer keys (a reusing layer under IndexCache with
    index_cache_skip_compressor has none)."""
    from .index_cache import index_cache_schedule

    s = index_cache_schedule(cfg)
    return s.computing if cfg.index_cache_skip_compressor else s.csa_layers


def cache_spec(cfg: ModelConfig, batch: int, max_len: int, dtype, lookahead: int = 0, *,
               block_size: int | None = None, num_blocks: int | None = None, kv_cache_dtype: str = "auto") -> dict:
    """Nested dict of (shape, dtype) with the cache's structure (see the module doc): `batch` rows
    of up to max_len tokens, pools of `num_blocks` blocks (default: batch * blocks_per_row) of
    `block_size` tokens (default: default_block_size), the rings' K=V rows and the compressed
    entries in `dtype` or (kv_cache_dtype "fp8") as FP8 records."""
    block_size = default_block_size(cfg) if block_size is None else block_size
    check_block_size(cfg, block_size)
    check_kv_cache_dtype(kv_cache_dtype)
    nb = blocks_per_row(max_len, block_size)
    NB = batch * nb if num_blocks is None else num_blocks
    Dh, dI, R = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window + lookahead
    f32 = jnp.float32
    # A ring's K=V row or a pool's entry: its FP8 record's words, or Dh values.
    entry = ((record_bytes(Dh, cfg.rope_head_dim) // 4,), jnp.uint32) if kv_cache_dtype == "fp8" else ((Dh,), dtype)
    spec: dict = {"pos": ((batch,), jnp.int32)}
    if _compress_ratios(cfg):
        spec["blocks"] = ((batch, nb), jnp.int32)
        spec["shared"] = ((batch,), jnp.int32)
        spec["folded"] = ((batch,), jnp.int32)
    for kind in KINDS:  # each kind's layers stacked on their own
        n = len(cfg.layers_of_ratio(kind.ratio))
        if not n:
            continue
        spec[kind.name] = {"ring": ((n, batch, R) + entry[0], entry[1])}
        if kind.ratio:
            E, s, w = block_size // kind.ratio, kind.state_rows(lookahead), kind.compressor_width(Dh)
            spec[kind.name].update(pool=((n, NB, E) + entry[0], entry[1]), state_a=((n, batch, s, w), f32),
                                   state_z=((n, batch, s, w), f32))
        ni = len(indexer_state_layers(cfg)) if kind.indexer else 0
        if ni:
            w = kind.compressor_width(dI)
            key = ((record_bytes(dI, 0) // 4,), jnp.uint32) if kv_cache_dtype == "fp8" else ((dI,), dtype)
            spec["indexer"] = {"pool": ((ni, NB, E) + key[0], key[1]), "state_a": ((ni, batch, s, w), f32),
                               "state_z": ((ni, batch, s, w), f32)}
    return spec


def block_bytes(cfg: ModelConfig, block_size: int, dtype=jnp.bfloat16, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block takes in all the pools together (every compressed layer's entries and
    indexer keys for block_size tokens)."""
    spec = cache_spec(cfg, 1, block_size, dtype, block_size=block_size, num_blocks=1, kv_cache_dtype=kv_cache_dtype)
    return sum(int(np.prod(g["pool"][0], dtype=np.int64)) * jnp.dtype(g["pool"][1]).itemsize
               for g in spec.values() if isinstance(g, dict) and "pool" in g)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, lookahead: int = 0, *,
               block_size: int | None = None, num_blocks: int | None = None, kv_cache_dtype: str = "auto") -> dict:
    """An empty cache for `batch` sequences of up to `max_len` tokens (see the module doc), each
    row its own blocks when the pools have them all (the default), else every row's table at
    block 0 (the caller hands blocks out); kv_cache_dtype: as cache_spec."""
    def walk(spec):
        return {k: jnp.zeros(*v) if isinstance(v, tuple) else walk(v) for k, v in spec.items()}

    cache = walk(cache_spec(cfg, batch, max_len, dtype, lookahead, block_size=block_size, num_blocks=num_blocks,
                            kv_cache_dtype=kv_cache_dtype))
    if "blocks" in cache and (num_blocks is None or num_blocks >= cache["blocks"].size):
        cache["blocks"] = jnp.arange(cache["blocks"].size, dtype=jnp.int32).reshape(cache["blocks"].shape)
    return cache


def recompute_span(cfg: ModelConfig, lookahead_layers: int = 0) -> int:
    """Tokens before a reuse point p that must run again, from any state, for every layer's window
    ring and compressor state at p to be what a run from position 0 gives. A layer's K=V rows at
    a position are exact once its input is; its outputs, W - 1 positions later (they read the
    window). So layer l's input is exact from l * (W - 1) positions after the restart, and at p
    the last layer needs W - 1 positions of its window, and the ratio-4 compressor the previous
    block (4), before p. `lookahead_layers` more layers run on the stack's output (the MTP block:
    one, its window one position behind)."""
    W = cfg.sliding_window
    return (cfg.num_layers - 1) * (W - 1) + max(W - 1, CSA) + lookahead_layers * W


def layers_to_run(cfg: ModelConfig, start: int, end: int) -> int:
    """How many of the stack's first layers must run on a chunk ending at position `end` (its
    last token at end - 1) of a row restarted at `start` > 0, inside a cached prefix, from any
    state (`recompute_span`). Layer l's input is exact only from start + l * (W - 1) on: what it
    reads and writes before that is never read by a position that needs to be exact (its window
    reaches back W - 1 positions and its compressed entries come from the shared blocks), so the
    layer may skip every chunk that ends before it. The layers above it skip it too; layers past
    the row's reuse point always all run. A row started at 0 runs every layer: its state is the
    sequence's own from its first token."""
    if start <= 0:
        return cfg.num_layers
    return min(cfg.num_layers, (end - 1 - start) // (cfg.sliding_window - 1) + 1)


def reset_rows(cache: dict, rows: jnp.ndarray, start=0) -> dict:
    """The cache with the rows where `rows` (bool `[B]`) is set restarted at position `start` (int
    or int32 `[B]`; 0: emptied, nothing they hold is read again), nothing folded into their
    compressor state; the others as they were."""
    moved = {k: jnp.where(rows, start, cache[k]) for k in ("pos", "folded") if k in cache}
    return {**cache, **moved}


def row_axis(path) -> int | None:
    """The row axis of a cache leaf (None for a pool, which the rows share)."""
    keys = tuple(getattr(k, "key", k) for k in path)
    if keys in ROW_LEAVES:
        return 0
    return None if keys[-1] == "pool" else 1


def take_rows(cache: dict, rows: jnp.ndarray) -> dict:
    """The sub-cache of the rows `rows` (int `[R]`), for a step on those rows alone: their
    positions, tables, rings and states, and the whole shared pools."""
    def take(path, a):
        axis = row_axis(path)
        return a if axis is None else jnp.take(a, rows, axis=axis)

    return jax.tree_util.tree_map_with_path(take, cache)


def put_rows(cache: dict, rows: jnp.ndarray, sub: dict) -> dict:
    """cache with the rows `rows` (int `[R]`) replaced by the sub-cache `sub` (as take_rows gives),
    and the pools by the sub-cache's (which the step wrote into)."""
    def put(path, a, b):
        axis = row_axis(path)
        if axis is None:
            return b
        return a.at[rows].set(b) if axis == 0 else a.at[:, rows].set(b)

    return jax.tree_util.tree_map_with_path(put, cache, sub)


def fork_rows(cache: dict, src: jnp.ndarray, dst: jnp.ndarray, src_block: jnp.ndarray | None = None,
              dst_block: jnp.ndarray | None = None) -> dict:
    """cache with row src[i] (int `[P]`) copied into row dst[i] (`[P]`): its position, table,
    reuse point, rings and compressor states; and in every pool, block src_block[i] copied into
    block dst_block[i] (`[P]`): the new row's own copy of the partly filled block it goes on
    writing into, its full blocks shared by the table. A dst or dst_block past the last is
    padding: nothing written."""
    def copy(path, a):
        axis = row_axis(path)
        if axis is None:
            return a.at[:, dst_block].set(a[:, src_block], mode="drop")
        return a.at[dst].set(a[src], mode="drop") if axis == 0 else a.at[:, dst].set(a[:, src], mode="drop")

    return jax.tree_util.tree_map_with_path(copy, cache)


def row_state(cache: dict) -> dict:
    """A cache's rows' state apart from their blocks: the cache less its pools, block table and
    reuse points (what `save_rows` keeps of a row: its position, fold point, rings and
    compressor states)."""
    out = {}
    for k, v in cache.items():
        if isinstance(v, dict):
            out[k] = {name: a for name, a in v.items() if name != "pool"}
        elif k not in ("blocks", "shared"):
            out[k] = v
    return out


def save_rows(saved: dict, at: jnp.ndarray, sub: dict) -> dict:
    """saved (a `row_state` tree of S rows) with row i of the cache `sub` stored as its row at[i]
    (int `[R]`; S or more: padding, nothing stored)."""
    def store(path, a, b):
        return a.at[at].set(b, mode="drop") if row_axis(path) == 0 else a.at[:, at].set(b, mode="drop")

    return jax.tree_util.tree_map_with_path(store, saved, row_state(sub))


def restore_rows(sub: dict, at: jnp.ndarray, saved: dict) -> dict:
    """The cache sub with the state of each row i whose at[i] (int `[R]`) is not negative replaced
    by row at[i] of saved (`save_rows`): its position, fold point, rings and compressor states; its
    table and reuse point stay its own."""
    use = at >= 0

    def load(path, b, a):
        axis = row_axis(path)
        got = jnp.take(a, jnp.maximum(at, 0), axis=axis)
        return jnp.where(use.reshape((1,) * axis + use.shape + (1,) * (b.ndim - axis - 1)), got, b)

    out = dict(sub)
    for k, v in jax.tree_util.tree_map_with_path(load, row_state(sub), saved).items():
        out[k] = {**sub[k], **v} if isinstance(v, dict) else v  # a kind's pool stays
    return out


def _by_group(pools: jnp.ndarray, blocks: jnp.ndarray, groups: int):
    """The block axis of pools `[n, NB, ...]` and the rows of blocks `[B, nb]` cut into `groups`
    equal groups, the table's ids made local to their group: row group g holds its blocks in
    block group g (as the engine and init_cache hand them out), so on a mesh that splits both the
    same way each device reads and writes only its own blocks."""
    NB = pools.shape[1]
    grouped = pools.reshape(pools.shape[:1] + (groups, NB // groups) + pools.shape[2:])
    return grouped, (blocks % (NB // groups)).reshape(groups, -1, blocks.shape[1])


def pool_view(pools: jnp.ndarray, layer, blocks: jnp.ndarray, groups: int = 1) -> jnp.ndarray:
    """Every row's entries in order: layer `layer` of pools `[n, NB, E, d]` read through the table
    blocks `[B, nb]` -> `[B, nb * E, d]` (entry e of row b at index e). groups: see `_by_group`.

    The reads here and in `pool_entries` index the stack itself, as `pool_write` does: a layer
    sliced out of it first is a copy of that layer's whole pool (XLA made one on TPU in every
    decode step, before gathering the few rows it needed)."""
    B, nb = blocks.shape
    E, d = pools.shape[2:]
    if groups == 1:
        return pools[layer, blocks].reshape(B, nb * E, d)
    p, t = _by_group(pools, blocks, groups)
    return jax.vmap(lambda p, t: p[layer, t], in_axes=(1, 0))(p, t).reshape(B, nb * E, d)


def _read(pools: jnp.ndarray, layer, blocks: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
    E = pools.shape[2]
    block = jnp.take_along_axis(blocks, (ids // E).reshape(ids.shape[0], -1), axis=1).reshape(ids.shape)
    return pools[layer, block, ids % E]


def pool_entries(pools: jnp.ndarray, layer, blocks: jnp.ndarray, ids: jnp.ndarray, groups: int = 1) -> jnp.ndarray:
    """The entries ids (int `[B, ...]`, in range) of each row, from layer `layer` of pools
    `[n, NB, E, d]` through the table blocks `[B, nb]` -> `[B, ..., d]`. groups: see `_by_group`."""
    if groups == 1:
        return _read(pools, layer, blocks, ids)
    p, t = _by_group(pools, blocks, groups)
    out = jax.vmap(_read, in_axes=(1, None, 0, 0))(p, layer, t, ids.reshape((groups, -1) + ids.shape[1:]))
    return out.reshape((-1,) + out.shape[2:])


def _write(pools: jnp.ndarray, layer, blocks: jnp.ndarray, ids: jnp.ndarray, values: jnp.ndarray) -> jnp.ndarray:
    E, nb = pools.shape[2], blocks.shape[1]
    inside = (ids >= 0) & (ids < nb * E)
    block = jnp.take_along_axis(blocks, jnp.clip(ids // E, 0, nb - 1), axis=1)
    block = jnp.where(inside, block, pools.shape[1])  # out of range: dropped
    return pools.at[layer, block, ids % E].set(values.astype(pools.dtype), mode="drop")


def pool_write(pools: jnp.ndarray, layer, blocks: jnp.ndarray, ids: jnp.ndarray, values: jnp.ndarray,
               groups: int = 1) -> jnp.ndarray:
    """pools `[n, NB, E, d]` with values `[B, m, d]` written as entries ids (int `[B, m]`) of each
    row of layer `layer`; an id outside the table (e.g. `nb * E`) is dropped. groups: see
    `_by_group`."""
    if groups == 1:  # the plain scatter: in place in the donated cache (no copy of the stack)
        return _write(pools, layer, blocks, ids, values)
    p, t = _by_group(pools, blocks, groups)
    ids, values = (a.reshape((groups, -1) + a.shape[1:]) for a in (ids, values))
    return jax.vmap(_write, in_axes=(1, None, 0, 0, 0), out_axes=1)(p, layer, t, ids, values).reshape(pools.shape)


def cache_bytes(cfg: ModelConfig, max_len: int, batch: int = 1, dtype=jnp.bfloat16, lookahead: int = 0,
                kv_cache_dtype: str = "auto") -> dict:
    """Bytes of a cache per layer kind (window rings included; the indexer's keys count as
    ratio-4; the block table apart): {"window": ..., "csa": ..., "hca": ..., "total": ...}."""
    spec = cache_spec(cfg, batch, max_len, dtype, lookahead, kv_cache_dtype=kv_cache_dtype)

    def size(s):
        if isinstance(s, tuple):
            return int(np.prod(s[0], dtype=np.int64)) * jnp.dtype(s[1]).itemsize
        return sum(size(v) for v in s.values())

    out = {k.name: size(spec.get(k.name, {})) + (size(spec.get("indexer", {})) if k.indexer else 0) for k in KINDS}
    out["total"] = sum(out.values())
    return out
