"""Attention of one layer: the query / shared K=V paths, the per-kind key sets, and the output.

Every layer attends to a sliding window of `sliding_window` keys (the token itself included).
Ratio-4 layers add the indexer's top-k compressed entries, ratio-128 layers all visible
compressed entries. The keys of a query are one index row into `kv_rows` (window rows first,
then compressed entries), fed to one sparse attention with the per-head sink.
"""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels  # looked up at call time: pallas_kernels imports our primitives

from .config import CSA, ModelConfig
from .indexer import indexer_scores, select_topk
from .linear import dense
from .norms import rms_norm, unweighted_rms_norm
from .rope import apply_rope, cos_sin


def query(p: dict, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, cfg: ModelConfig):
    """x `[B, S, D]` -> (q `[B, S, H, Dh]`, q latent `[B, S, Q]`).

    q = per-head unweighted RMS of wq_b(q_norm(wq_a x)), rope on its last dims."""
    c_q = rms_norm(dense(x, p["wq_a"]), p["q_norm"], cfg.rms_norm_eps)
    q = dense(c_q, p["wq_b"]).reshape(*x.shape[:-1], cfg.num_heads, cfg.head_dim)
    q = unweighted_rms_norm(q, cfg.rms_norm_eps)
    return apply_rope(q, cos[..., None, :], sin[..., None, :]), c_q


def key_value(p: dict, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """x `[B, S, D]` -> the shared K=V row `[B, S, Dh]`: kv_norm(wkv x), rope on its last dims."""
    kv = rms_norm(dense(x, p["wkv"]), p["kv_norm"], cfg.rms_norm_eps)
    return apply_rope(kv, cos, sin)


def output(p: dict, o: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """o `[B, S, H, Dh]` -> `[B, S, D]`: inverse rope at the query position, then the grouped
    low-rank projection (wo_a per group of H/G heads, then wo_b)."""
    o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
    B, S = o.shape[:2]
    G = cfg.o_groups
    o = o.reshape(B, S, G, -1)
    wo_a = p["wo_a"].reshape(G, cfg.o_lora_rank, -1)
    z = jnp.einsum("bsgd,grd->bsgr", o.astype(wo_a.dtype), wo_a, preferred_element_type=jnp.float32)
    z = z.astype(wo_a.dtype).reshape(B, S, -1)
    return dense(z, p["wo_b"])


def window_indices(seq_len: int, window: int) -> jnp.ndarray:
    """`[S, min(S, window)]` int32: for query t the positions t-w+1..t, oldest first, -1 before 0."""
    w = min(seq_len, window)
    idx = jnp.arange(seq_len, dtype=jnp.int32)[:, None] - (w - 1) + jnp.arange(w, dtype=jnp.int32)[None, :]
    return jnp.where(idx >= 0, idx, -1)


def compress_blocks(cp: dict, x: jnp.ndarray, ratio: int, freqs: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """Every complete block of x `[B, S, D]` -> compressed entries `[B, S // ratio, d]` (x's dtype).

    The projections run in fp32 on the fp32 input; `ape` is added by in-block position; entry j
    is rotated at position j * ratio."""
    B, S, _ = x.shape
    n = S // ratio
    xf = x[:, : n * ratio].astype(jnp.float32)
    a = dense(xf, cp["wkv"].astype(jnp.float32))
    z = dense(xf, cp["wgate"].astype(jnp.float32)) + jnp.tile(cp["ape"].astype(jnp.float32), (n, 1))
    cos, sin = cos_sin(jnp.arange(n) * ratio, freqs)
    cos, sin = jnp.broadcast_to(cos, (B,) + cos.shape), jnp.broadcast_to(sin, (B,) + sin.shape)
    return pallas_kernels.compress_ref(a, z, cp["norm"], cos, sin, ratio=ratio, eps=cfg.rms_norm_eps, out_dtype=x.dtype)


def indexer_topk(ip: dict, x: jnp.ndarray, c_q: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray,
                 freqs: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """Top-min(index_topk, S // 4) compressed entries per query of a whole sequence.

    x `[B, S, D]`, c_q `[B, S, Q]`, cos/sin `[S, rope/2]` at the query positions.
    Returns int32 `[B, S, K]` entry ids, -1 where fewer entries are visible."""
    B, S, _ = x.shape
    keys = compress_blocks(ip["compressor"], x, CSA, freqs, cfg)
    n = keys.shape[1]
    q = dense(c_q, ip["wq_b"]).reshape(B, S, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, cos[..., None, :], sin[..., None, :])
    w = dense(x, ip["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    scores = indexer_scores(q, keys, w)
    n_visible = jnp.broadcast_to((jnp.arange(S, dtype=jnp.int32) + 1) // CSA, (B, S))
    return select_topk(scores, n_visible, min(cfg.index_topk, n))


def attend(q: jnp.ndarray, kv_rows: jnp.ndarray, indices: jnp.ndarray, sink: jnp.ndarray,
           cfg: ModelConfig) -> jnp.ndarray:
    """Sparse attention of q `[B, S, H, Dh]` over the kv rows named by indices `[B, S, K]`."""
    return pallas_kernels.sparse_attention_ref(q, kv_rows, indices, sink, scale=cfg.head_dim ** -0.5)
