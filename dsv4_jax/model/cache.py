"""Decode state, grouped per layer kind like the parameters, with static shapes set by `max_len`.

Every row (sequence) has its own position, and everything of it is addressed by position: the
window's K=V rows and the compressors' projections in rings (position s in slot s % size), the
compressed entries in pools (entry j in row j). `lookahead` (default 0) widens the rings by the
positions a step may write beyond those it keeps (speculative decoding: drafts that a
verification rejects); a row's position then simply stays before them, and they are overwritten
later, before anything reads those slots.

    pos            int32 [B]                tokens already in each row
    window (window-only layers, n of them):
      ring         [n, B, W + la, Dh]           sliding-window K=V rows
    csa (ratio-4 layers):
      ring         [n, B, W + la, Dh]
      pool         [n, B, max_len // 4, Dh]     compressed entries, entry j in row j
      state_a/z    [n, B, 8 + la, 2 Dh]  fp32   projections of the recent positions (the previous
                                                block and the current one); z includes `ape`
    indexer (ratio-4 layers that run their indexer's compressor: all of them, or only those that
             compute their top-k under IndexCache with index_cache_skip_compressor):
      pool         [n, B, max_len // 4, dI]     the indexer's keys
      state_a/z    [n, B, 8 + la, 2 dI]  fp32
    hca (ratio-128 layers):
      ring         [n, B, W + la, Dh]
      pool         [n, B, max_len // 128, Dh]
      state_a/z    [n, B, 128 + la, Dh]  fp32   projections of the current block's positions

A row reads only slots and entries of positions below its own that it wrote itself (positions
before 0 count as missing: a block before the first gets softmax weight 0), so a row is reset by
setting its position to 0 (`reset_rows`), and rows past a position hold don't-cares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .layer_kinds import KINDS


def pool_rows(max_len: int, ratio: int) -> int:
    """Compressed entries a cache of max_len tokens can hold (at least one row, so every array
    has a row to gather from)."""
    return max(1, max_len // ratio)


def indexer_state_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Ids of the ratio-4 layers that keep indexer keys (a reusing layer under IndexCache with
    index_cache_skip_compressor has none)."""
    from .index_cache import index_cache_schedule

    s = index_cache_schedule(cfg)
    return s.computing if cfg.index_cache_skip_compressor else s.csa_layers


def cache_spec(cfg: ModelConfig, batch: int, max_len: int, dtype, lookahead: int = 0) -> dict:
    """Nested dict of (shape, dtype) with the cache's structure (see the module doc)."""
    Dh, dI, R = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window + lookahead
    f32 = jnp.float32
    spec: dict = {"pos": ((batch,), jnp.int32)}
    for kind in KINDS:  # each kind's layers stacked on their own
        n = len(cfg.layers_of_ratio(kind.ratio))
        if not n:
            continue
        spec[kind.name] = {"ring": ((n, batch, R, Dh), dtype)}
        if kind.ratio:
            p, s, w = pool_rows(max_len, kind.ratio), kind.state_rows(lookahead), kind.compressor_width(Dh)
            spec[kind.name].update(pool=((n, batch, p, Dh), dtype), state_a=((n, batch, s, w), f32),
                                   state_z=((n, batch, s, w), f32))
        ni = len(indexer_state_layers(cfg)) if kind.indexer else 0
        if ni:
            w = kind.compressor_width(dI)
            spec["indexer"] = {"pool": ((ni, batch, p, dI), dtype), "state_a": ((ni, batch, s, w), f32),
                               "state_z": ((ni, batch, s, w), f32)}
    return spec


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, lookahead: int = 0) -> dict:
    """An empty cache for `batch` sequences of up to `max_len` tokens (see the module doc)."""
    def walk(spec):
        return {k: jnp.zeros(*v) if isinstance(v, tuple) else walk(v) for k, v in spec.items()}

    return walk(cache_spec(cfg, batch, max_len, dtype, lookahead))


def reset_rows(cache: dict, rows: jnp.ndarray) -> dict:
    """The cache with the rows where `rows` (bool `[B]`) is set emptied (position 0: nothing they
    hold is read again); the others as they were."""
    return {**cache, "pos": jnp.where(rows, 0, cache["pos"])}


def take_rows(cache: dict, rows: jnp.ndarray) -> dict:
    """The sub-cache of the rows `rows` (int `[R]`), for a step on those rows alone."""
    return {k: v[rows] if k == "pos" else jax.tree.map(lambda a: a[:, rows], v) for k, v in cache.items()}


def put_rows(cache: dict, rows: jnp.ndarray, sub: dict) -> dict:
    """cache with the rows `rows` (int `[R]`) replaced by the sub-cache `sub` (as take_rows gives)."""
    return {k: cache[k].at[rows].set(v) if k == "pos" else
            jax.tree.map(lambda a, b: a.at[:, rows].set(b), cache[k], v) for k, v in sub.items()}


def cache_bytes(cfg: ModelConfig, max_len: int, batch: int = 1, dtype=jnp.bfloat16, lookahead: int = 0) -> dict:
    """Bytes of a cache per layer kind (window rings included; the indexer's keys count as
    ratio-4): {"window": ..., "csa": ..., "hca": ..., "total": ...}."""
    spec = cache_spec(cfg, batch, max_len, dtype, lookahead)

    def size(s):
        if isinstance(s, tuple):
            return int(np.prod(s[0], dtype=np.int64)) * jnp.dtype(s[1]).itemsize
        return sum(size(v) for v in s.values())

    out = {k.name: size(spec.get(k.name, {})) + (size(spec.get("indexer", {})) if k.indexer else 0) for k in KINDS}
    out["total"] = sum(out.values())
    return out
