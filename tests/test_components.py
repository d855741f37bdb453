"""Per-component numerical parity of our JAX functions against the transformers DeepSeek-V4 modules.

Everything runs in fp32 on CPU with JAX matmuls at "highest" precision, so the only differences
left are summation order and the last ulp of transcendental functions. Unless a test says
otherwise, errors are measured as max|ours - ref| / max|ref| (a relative error on the scale of
the tensor, which is meaningful for entries that happen to be near 0, unlike an element-wise
rtol). Every transformers submodule is randomised with hf_oracle.randomize's rules (sinks,
position_bias / ape, e_score_correction_bias, hc base/scale and tid2eid included), and
`_randomized` asserts that none of those is left at its trivial init value.
"""

from __future__ import annotations

from functools import partial

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_jax.model import attention as ours_attn  # noqa: E402
from dsv4_jax.model import layer_weights, moe, xla_cpu  # noqa: E402
from dsv4_jax.model.linear import dense  # noqa: E402
from dsv4_jax.model.config import ModelConfig, Yarn  # noqa: E402
from dsv4_jax.model.layer_kinds import BY_RATIO, CSA, HCA  # noqa: E402
from dsv4_jax.model.hyper_connection import hc_head, hc_post, hc_pre  # noqa: E402
from dsv4_jax.model.indexer import select_topk  # noqa: E402
from pallas_kernels import indexer_scores_ref  # noqa: E402
from dsv4_jax.model.moe import (learned_choice, route, routed_experts, router_scores,  # noqa: E402
                          shared_expert)
from pallas_kernels.numerics import apply_rope
from dsv4_jax.model.rope import cos_sin, inv_freq, layer_inv_freqs  # noqa: E402
from pallas_kernels import sparse_attention_ref  # noqa: E402

import hf_oracle  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M  # noqa: E402

CONFIGS = {"tiny": hf_oracle.TINY, "flash": hf_oracle.FLASH_SHAPED}

# Jitted entry points (one XLA compile per shape instead of one per primitive keeps the file
# fast; the model runs these functions under jit too).


def _fresh_state(batch: int, ratio: int, width: int):
    rows = BY_RATIO[ratio].state_rows()
    return (jnp.zeros((batch, rows, width), jnp.float32), jnp.full((batch, rows, width), -jnp.inf, jnp.float32))


@partial(jax.jit, static_argnums=(2, 4))
def _compress_blocks(cp, x, ratio, freqs, cfg):
    """Every complete block of a whole sequence, through the chunk compressor from position 0."""
    B, S, _ = x.shape
    sa, sz = _fresh_state(B, ratio, cp["wkv"].shape[0])
    entries = ours_attn.compress_chunk(cp, x, sa, sz, jnp.int32(0), ratio, freqs, cfg)[0]
    return entries[:, : S // ratio]


@partial(jax.jit, static_argnums=(6,))
def _indexer_topk(ip, x, c_q, cos, sin, freqs, cfg):
    """The indexer's selection for a whole sequence from position 0 (an empty key pool of S // 4
    rows, as a cache sized for this sequence has)."""
    B, S, _ = x.shape
    sa, sz = _fresh_state(B, CSA, ip["compressor"]["wkv"].shape[0])
    pool = jnp.zeros((B, max(1, S // CSA), cfg.index_head_dim), x.dtype)
    keys = ours_attn.compress_chunk(ip["compressor"], x, sa, sz, jnp.int32(0), CSA, freqs, cfg)[0]
    p0 = jnp.int32(0)
    scores = ours_attn.indexer_logits(ip, x, c_q, cos, sin, pool, keys, p0, cfg)
    return ours_attn.indexer_select(scores, p0, pool.shape[1], cfg)


_select_topk = jax.jit(select_topk, static_argnums=(2,))
_hc_pre = jax.jit(hc_pre, static_argnames=("hc", "iters", "hc_eps", "norm_eps"))
_routed_experts = jax.jit(routed_experts, static_argnums=(6,))
_shared_expert = jax.jit(shared_expert, static_argnums=(4,))


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _hf_cfg(d: dict, **over):
    return hf_oracle.hf_config(dict(d, **over))


def _our_cfg(hf_cfg) -> ModelConfig:
    return ModelConfig.from_hf(hf_cfg.to_dict())


def _randomized(module: torch.nn.Module, hf_cfg, seed: int) -> torch.nn.Module:
    """hf_oracle.randomize on a bare submodule (it reads `.config` for tid2eid), then a check that
    no parameter transformers initialises trivially kept its trivial value."""
    holder = torch.nn.Module()
    holder.config = hf_cfg
    holder.m = module
    hf_oracle.randomize(holder, seed)
    module.float().eval()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("sinks", "position_bias", "e_score_correction_bias", "base", "hc_base"):
            assert t.abs().min() > 0, name
        if leaf in ("scale", "hc_scale"):
            assert (t != 1).all(), name
        if leaf == "tid2eid":
            assert (t.sort(-1).values.diff(dim=-1) > 0).all(), name  # k distinct experts per token
            assert len(torch.unique(t)) > 1, name
    return module


def _j(t) -> jnp.ndarray:
    return jnp.asarray(t.detach().numpy() if isinstance(t, torch.Tensor) else t)


def _n(x) -> np.ndarray:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _rel_err(ours, ref) -> float:
    ours, ref = np.asarray(_n(ours), np.float64), np.asarray(_n(ref), np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.all(np.isfinite(ours)) and np.all(np.isfinite(ref))
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-30))


def assert_close(ours, ref, tol: float, what: str = "") -> None:
    err = _rel_err(ours, ref)
    assert err <= tol, f"{what}: max|ours - ref| / max|ref| = {err:.3g} > {tol:g}"


def _randn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=g)


def _compressor_params(kv_proj, gate_proj, position_bias, kv_norm) -> dict:
    return {"wkv": _j(kv_proj.weight), "wgate": _j(gate_proj.weight), "ape": _j(position_bias),
            "norm": _j(kv_norm.weight)}


# ---------------------------------------------------------------------------------------------
# 1. RoPE
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "flash"])
def test_rope_inv_freq(name):
    """Our inv_freq vs the rotary module's main (plain theta) and compress (YaRN) buffers.

    Tolerance: 2.5e-7 element-wise relative (2 fp32 ulps): both sides evaluate the same fp32
    formula, but base ** (2i/d) comes from numpy's pow on our side and torch's on theirs, which
    may differ in the last ulp (observed: exact for TINY, 1 ulp for the Flash geometry)."""
    hf_cfg = _hf_cfg(CONFIGS[name])
    cfg = _our_cfg(hf_cfg)
    assert cfg.yarn is not None
    rot = M.DeepseekV4RotaryEmbedding(hf_cfg)
    assert rot.main_attention_scaling == 1.0 and rot.compress_attention_scaling == 1.0  # no YaRN mscale
    main, compress = layer_inv_freqs(cfg)
    assert main.dtype == np.float32 and compress.dtype == np.float32
    np.testing.assert_allclose(main, _n(rot.main_inv_freq), rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(compress, _n(rot.compress_inv_freq), rtol=2.5e-7, atol=0)
    # YaRN really interpolates some pairs (and keeps pair 0) in both geometries.
    plain = inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, None)
    assert compress[0] == plain[0] and np.any(compress < 0.5 * plain)


def test_rope_inv_freq_flash_documented_values():
    """Flash numbers (base 160000, YaRN factor 16 over 65536, beta 32/1, rope dim 64).

    Tolerance: 1e-5 relative, the precision the documented values are given with (6 digits)."""
    f = inv_freq(64, 160000.0, Yarn(factor=16, original_max_position_embeddings=65536, beta_fast=32,
                                    beta_slow=1))
    assert f.shape == (32,)
    np.testing.assert_allclose(f[1], 0.687656, rtol=1e-5)
    np.testing.assert_allclose(f[31], 5.68053e-7, rtol=1e-5)


def test_rope_inv_freq_bit_exact_flash():
    """Bit parity of the Flash-geometry inv_freq with transformers (exact equality)."""
    hf_cfg = _hf_cfg(hf_oracle.FLASH_SHAPED)
    rot = M.DeepseekV4RotaryEmbedding(hf_cfg)
    main, compress = layer_inv_freqs(_our_cfg(hf_cfg))
    np.testing.assert_array_equal(main, _n(rot.main_inv_freq))
    np.testing.assert_array_equal(compress, _n(rot.compress_inv_freq))


@pytest.mark.parametrize("name", ["tiny", "flash"])
@pytest.mark.parametrize("layer_type", ["main", "compress"])
@torch.no_grad()
def test_apply_rope(name, layer_type):
    """cos_sin + apply_rope (forward and inverse) vs the rotary module + apply_rotary_pos_emb, on
    random tensors at random positions, including 100000 and 2**20 - 1.

    Tolerances:
    * cos_sin fed transformers' inv_freq vs the rotary module: 1e-6 absolute — the fp32 angles
      (position * inv_freq) are identical, then cos/sin of torch vs XLA, each within ~1 ulp of a
      value <= 1 (observed 6e-8).
    * apply_rope vs apply_rotary_pos_emb on the same cos/sin: 1e-6 relative (two products and a
      sum per element; observed ~1e-7), forward and inverse (transformers' -sin).
    * the full chain with our own inv_freq: |cos/sin error| <= position * |inv_freq error|
      + 1 ulp of the fp32 angle (each side rounds its own product) + 1e-6, per element. Our
      inv_freq may be 1 ulp off transformers' (see test_rope_inv_freq_bit_exact_flash), so at
      position ~1e5 the angles legitimately differ by up to ~1e-3..1e-2 rad for those pairs; for
      pairs where inv_freq agrees the bound is 1e-6.
    * inverse(forward(x)) == x to 1e-6 relative; the nope dims pass through bit-exactly."""
    hf_cfg = _hf_cfg(CONFIGS[name])
    cfg = _our_cfg(hf_cfg)
    ours_freqs = layer_inv_freqs(cfg)[layer_type == "compress"]
    rot = M.DeepseekV4RotaryEmbedding(hf_cfg)
    hf_freqs = _n(getattr(rot, f"{layer_type}_inv_freq"))
    g = torch.Generator().manual_seed(1)
    B, S, H, D = 2, 7, 3, 2 * cfg.rope_head_dim + 16  # nope dims in front of the rope dims
    pos = torch.randint(0, 200_000, (B, S), generator=g)
    pos[0, 0], pos[0, 1], pos[1, 0], pos[1, 1] = 0, 100_000, 1_048_575, 65_537
    x = _randn(g, B, S, H, D)

    cos_t, sin_t = rot(x, position_ids=pos, layer_type=layer_type)  # [B, S, rope/2]
    cos_h, sin_h = cos_sin(_j(pos), jnp.asarray(hf_freqs))
    np.testing.assert_allclose(_n(cos_h), _n(cos_t), atol=1e-6, rtol=0)
    np.testing.assert_allclose(_n(sin_h), _n(sin_t), atol=1e-6, rtol=0)

    x_hf = x.transpose(1, 2)  # transformers' [B, H, S, D]; unsqueeze_dim=1 broadcasts over heads
    fwd_t = M.apply_rotary_pos_emb(x_hf, cos_t, sin_t).transpose(1, 2)
    inv_t = M.apply_rotary_pos_emb(x_hf, cos_t, -sin_t).transpose(1, 2)
    ct, st = _j(cos_t)[:, :, None, :], _j(sin_t)[:, :, None, :]
    assert_close(apply_rope(_j(x), ct, st), fwd_t, 1e-6, "forward rope")
    assert_close(apply_rope(_j(x), ct, st, inverse=True), inv_t, 1e-6, "inverse rope")

    # full chain with our inv_freq
    cos_j, sin_j = cos_sin(_j(pos), jnp.asarray(ours_freqs))
    angle = _n(pos)[..., None].astype(np.float32) * hf_freqs  # fp32, as both sides round it
    bound = (_n(pos)[..., None].astype(np.float64) * np.abs(ours_freqs.astype(np.float64) - hf_freqs)
             + np.where(ours_freqs != hf_freqs, np.spacing(np.abs(angle)), 0) + 1e-6)
    assert np.all(np.abs(_n(cos_j) - _n(cos_t)) <= bound)
    assert np.all(np.abs(_n(sin_j) - _n(sin_t)) <= bound)
    cj, sj = cos_j[:, :, None, :], sin_j[:, :, None, :]
    fwd_j = apply_rope(_j(x), cj, sj)
    assert_close(apply_rope(fwd_j, cj, sj, inverse=True), x, 1e-6, "inverse(forward(x))")
    nope = D - cfg.rope_head_dim
    np.testing.assert_array_equal(_n(fwd_j)[..., :nope], _n(x)[..., :nope])
    assert _rel_err(fwd_j, x) > 0.1  # the rope dims really rotate


# ---------------------------------------------------------------------------------------------
# 2. mHC
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hc", [2, 4])
@torch.no_grad()
def test_hyper_connection(hc):
    """hc_pre vs DeepseekV4HyperConnection, hc_post vs the decoder layer's
    `post * f + comb^T @ streams`, hc_head vs DeepseekV4HyperHead.

    Tolerance: 1e-5 relative. Everything is fp32 with sums over <= hc*D = 128 terms; the 20
    Sinkhorn iterations are contractive normalisations, so differences stay at the 1e-7 level
    (observed ~1e-7)."""
    hf_cfg = _hf_cfg(hf_oracle.TINY, hc_mult=hc)
    cfg = _our_cfg(hf_cfg)
    hc_mod = _randomized(M.DeepseekV4HyperConnection(hf_cfg), hf_cfg, seed=10 + hc)
    head = _randomized(M.DeepseekV4HyperHead(hf_cfg), hf_cfg, seed=20 + hc)
    g = torch.Generator().manual_seed(hc)
    B, S, D = 2, 5, cfg.hidden_size
    x = _randn(g, B, S, hc, D)
    f = _randn(g, B, S, D)

    post_t, comb_t, collapsed_t = hc_mod(x)
    collapsed, post, comb = _hc_pre(_j(x), _j(hc_mod.fn), _j(hc_mod.base), _j(hc_mod.scale), hc=hc,
                                    iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    assert cfg.hc_sinkhorn_iters == 20
    assert_close(collapsed, collapsed_t, 1e-5, "collapsed")
    assert_close(post, post_t, 1e-5, "post")
    assert_close(comb, comb_t, 1e-5, "comb")
    # comb must be non-symmetric, or applying it untransposed would go unnoticed (a 2x2 doubly
    # stochastic matrix is always symmetric, so only hc > 2 can tell)
    if hc > 2:
        assert np.max(np.abs(_n(comb_t) - np.swapaxes(_n(comb_t), -1, -2))) > 1e-3

    # the decoder layer's expansion, verbatim
    ref = post_t.unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb_t.transpose(-1, -2), x)
    assert_close(hc_post(_j(f), _j(x), post, comb), ref, 1e-5, "hc_post")
    # and with transformers' own post/comb fed in (isolates the expansion formula)
    assert_close(hc_post(_j(f), _j(x), _j(post_t), _j(comb_t)), ref, 1e-6, "hc_post (shared weights)")

    y = hc_head(_j(x), _j(head.hc_fn), _j(head.hc_base), _j(head.hc_scale), hc_eps=cfg.hc_eps,
                norm_eps=cfg.rms_norm_eps)
    assert_close(y, head(x), 1e-5, "hc_head")


# ---------------------------------------------------------------------------------------------
# 3. Compressors
# ---------------------------------------------------------------------------------------------

def _hook_scorer(indexer) -> tuple[dict, object]:
    store: dict = {}

    def hook(mod, args, out):
        store["q"], store["keys"], store["scores"] = args[0], args[1], out

    return store, indexer.scorer.register_forward_hook(hook)


@pytest.mark.parametrize("name,S", [("tiny", 16), ("tiny", 19), ("tiny", 6), ("flash", 13)])
@torch.no_grad()
def test_csa_compressor_and_indexer_compressor(name, S):
    """compress_chunk (ratio 4, overlapping) vs DeepseekV4CSACompressor's compressed_kv, and the
    indexer's own compressor (d = index_head_dim) vs the keys the indexer hands its scorer.
    Lengths that are multiples of 4 and not (the incomplete tail block is dropped).

    Tolerance: 1e-5 relative: fp32 projections over D inputs, an 8-way softmax pooling, an RMS
    norm and a rotation (observed ~1e-7)."""
    hf_cfg = _hf_cfg(CONFIGS[name])
    cfg = _our_cfg(hf_cfg)
    comp = _randomized(M.DeepseekV4CSACompressor(hf_cfg), hf_cfg, seed=30 + S)
    idx = comp.indexer
    freqs = jnp.asarray(layer_inv_freqs(cfg)[1])
    g = torch.Generator().manual_seed(S)
    B = 2
    x = _randn(g, B, S, cfg.hidden_size)
    q_res = _randn(g, B, S, cfg.q_lora_rank)
    pos = torch.arange(S)[None].expand(B, -1)

    store, handle = _hook_scorer(idx)
    try:
        kv_t, _ = comp(x, q_res, pos, None, 0)
    finally:
        handle.remove()
    n = S // CSA
    assert kv_t.shape == (B, 1, n, cfg.head_dim)

    cp = _compressor_params(comp.kv_proj, comp.gate_proj, comp.position_bias, comp.kv_norm)
    ours = _compress_blocks(cp, _j(x), CSA, freqs, cfg)
    assert_close(ours, kv_t[:, 0], 1e-5, "CSA compressed entries")

    ip = _compressor_params(idx.kv_proj, idx.gate_proj, idx.position_bias, idx.kv_norm)
    ours_keys = _compress_blocks(ip, _j(x), CSA, freqs, cfg)
    assert store["keys"].shape == (B, n, cfg.index_head_dim)
    assert_close(ours_keys, store["keys"], 1e-5, "indexer compressed keys")


@pytest.mark.parametrize("S", [256, 300])
@torch.no_grad()
def test_hca_compressor(S):
    """compress_chunk (ratio 128, no overlap) vs DeepseekV4HCACompressor, S a multiple of 128
    and not.

    Tolerance: 1e-5 relative: as the CSA compressor, with a 128-way softmax pooling (observed
    ~3e-7)."""
    hf_cfg = _hf_cfg(hf_oracle.TINY)
    cfg = _our_cfg(hf_cfg)
    comp = _randomized(M.DeepseekV4HCACompressor(hf_cfg), hf_cfg, seed=40 + S)
    g = torch.Generator().manual_seed(S)
    B = 2
    x = _randn(g, B, S, cfg.hidden_size)
    q_res = _randn(g, B, S, cfg.q_lora_rank)
    kv_t, _ = comp(x, q_res, torch.arange(S)[None].expand(B, -1), None, 0)
    assert kv_t.shape == (B, 1, S // HCA, cfg.head_dim)
    cp = _compressor_params(comp.kv_proj, comp.gate_proj, comp.position_bias, comp.kv_norm)
    ours = _compress_blocks(cp, _j(x), HCA, jnp.asarray(layer_inv_freqs(cfg)[1]), cfg)
    assert_close(ours, kv_t[:, 0], 1e-5, "HCA compressed entries")


# ---------------------------------------------------------------------------------------------
# 4. Indexer top-k sets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,S", [("tiny", 40), ("tiny", 43), ("flash", 90)])
@torch.no_grad()
def test_indexer_topk_sets(name, S):
    """indexer_select vs DeepseekV4Indexer.forward (cache=None), with S long enough that top-k is
    smaller than the number of visible entries for the later queries.

    Compared: the scores (indexer_scores_ref vs the scorer's output) on visible entries, 1e-5
    relative (fp32 dot products over index_head_dim, ReLU and a head-weighted sum; observed
    <= 4e-7); the -1 slots
    exactly; the SETS of valid entries per query exactly, except where two candidates' scores
    are within 1e-5 (relative) of each other, where the chosen scores must agree as multisets."""
    hf_cfg = _hf_cfg(CONFIGS[name])
    cfg = _our_cfg(hf_cfg)
    idx = _randomized(M.DeepseekV4Indexer(hf_cfg), hf_cfg, seed=50 + S)
    freqs = jnp.asarray(layer_inv_freqs(cfg)[1])
    g = torch.Generator().manual_seed(100 + S)
    B = 2
    x = _randn(g, B, S, cfg.hidden_size)
    q_res = _randn(g, B, S, cfg.q_lora_rank)
    pos = torch.arange(S)[None].expand(B, -1)

    store, handle = _hook_scorer(idx)
    try:
        top_t = _n(idx(x, q_res, pos, None, 0))
    finally:
        handle.remove()
    ip = {"wq_b": _j(idx.q_b_proj.weight), "weights_proj": _j(idx.scorer.weights_proj.weight),
          "compressor": _compressor_params(idx.kv_proj, idx.gate_proj, idx.position_bias, idx.kv_norm)}
    cos, sin = cos_sin(jnp.arange(S), freqs)
    top = _n(_indexer_topk(ip, _j(x), _j(q_res), cos, sin, freqs, cfg))

    n = S // CSA
    k = min(cfg.index_topk, n)
    assert top.shape == top_t.shape == (B, S, k)
    visible = (np.arange(S) + 1) // CSA
    assert np.any(visible > k), "sequence too short: top-k never smaller than the visible entries"

    # scores, recomputed with our pieces from the keys/queries (independently of the hook's inputs)
    keys = _compress_blocks(ip["compressor"], _j(x), CSA, freqs, cfg)
    q = apply_rope((_j(q_res) @ ip["wq_b"].T).reshape(B, S, cfg.index_n_heads, cfg.index_head_dim),
                   cos[:, None, :], sin[:, None, :])
    w = (_j(x) @ ip["weights_proj"].T) * cfg.index_n_heads ** -0.5
    scores = _n(indexer_scores_ref(q, keys, w))
    scores_t = _n(store["scores"])
    vis_mask = np.arange(n)[None, :] < visible[:, None]  # [S, n]
    assert_close(np.where(vis_mask, scores, 0), np.where(vis_mask, scores_t, 0), 1e-5, "indexer scores")

    np.testing.assert_array_equal(top < 0, top_t < 0)  # the -1 slots, position by position
    np.testing.assert_array_equal((top >= 0).sum(-1), np.broadcast_to(np.minimum(visible, k), (B, S)))
    tie_tol = 1e-5 * np.abs(scores_t).max()
    n_exact = 0
    for b in range(B):
        for t in range(S):
            mine, theirs = set(top[b, t][top[b, t] >= 0]), set(top_t[b, t][top_t[b, t] >= 0])
            assert all(j < visible[t] for j in mine), (b, t, mine)
            if mine == theirs:
                n_exact += 1
                continue
            a = np.sort(scores_t[b, t, sorted(mine)])
            c = np.sort(scores_t[b, t, sorted(theirs)])
            assert np.max(np.abs(a - c)) <= tie_tol, (b, t, sorted(mine), sorted(theirs))
    assert n_exact >= B * S - 2  # random scores: near-ties are (almost) never hit


# ---------------------------------------------------------------------------------------------
# 4b. Deterministic tie-break of select_topk
# ---------------------------------------------------------------------------------------------

def test_select_topk_tie_break():
    """Exact ties go to the lower entry index; trailing invisible entries (whatever their
    scores, even larger or tied ones) never change the selection. Exact integer comparisons."""
    row = np.array([3, 1, 3, 2, 3, 0, 2, 2], np.float32)
    cases = [  # (n_visible, k, expected)
        (8, 2, [0, 2]),
        (8, 4, [0, 2, 4, 3]),
        (8, 5, [0, 2, 4, 3, 6]),
        (8, 7, [0, 2, 4, 3, 6, 7, 1]),
        (5, 4, [0, 2, 4, 3]),
        (4, 4, [0, 2, 3, 1]),
        (2, 4, [0, 1, -1, -1]),
        (0, 3, [-1, -1, -1]),
    ]
    for pad_scores in (None, 0.0, 3.0, 100.0, -5.0):
        for n_pad in (0, 1, 5, 29):
            if pad_scores is None and n_pad:
                continue
            s = np.concatenate([row, np.full(n_pad, pad_scores if pad_scores is not None else 0, np.float32)])
            for n_vis, k, expected in cases:
                got = _n(_select_topk(jnp.asarray(s)[None, None], jnp.full((1, 1), n_vis, jnp.int32), k))
                np.testing.assert_array_equal(got[0, 0], expected, err_msg=f"pad={pad_scores}x{n_pad} "
                                              f"n_visible={n_vis} k={k}")

    # Many ties at random: the selection equals a stable descending sort of the visible scores,
    # for every padding of the entry axis.
    rng = np.random.default_rng(0)
    B, T, N, k = 2, 16, 24, 6
    s = rng.integers(0, 4, (B, T, N)).astype(np.float32)
    n_vis = rng.integers(0, N + 1, (B, T)).astype(np.int32)
    expected = np.full((B, T, k), -1)
    for b in range(B):
        for t in range(T):
            order = np.argsort(-s[b, t, : n_vis[b, t]], kind="stable")[:k]
            expected[b, t, : len(order)] = order
    for n_pad in (0, 3, 40):
        padded = np.concatenate([s, rng.integers(0, 6, (B, T, n_pad)).astype(np.float32)], axis=-1)
        got = _n(_select_topk(jnp.asarray(padded), jnp.asarray(n_vis), k))
        np.testing.assert_array_equal(got, expected, err_msg=f"n_pad={n_pad}")


# ---------------------------------------------------------------------------------------------
# 5. Sparse attention with sink
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "flash"])
@torch.no_grad()
def test_sparse_attention_with_sink(name):
    """sparse_attention_ref vs eager_attention_forward (per-head sinks, shared K=V head) on a
    dense additive mask built from the index rows; -1 padding slots anywhere in a row, and one
    row with no valid key, which must give exactly 0.

    Tolerance: 1e-5 relative: fp32 dot products over head_dim (up to 512) and a softmax over
    <= 12 keys plus the sink (observed <= 7e-7)."""
    hf_cfg = _hf_cfg(CONFIGS[name])
    cfg = _our_cfg(hf_cfg)
    mod = _randomized(M.DeepseekV4Attention(hf_cfg, 0), hf_cfg, seed=60)
    H, D = cfg.num_heads, cfg.head_dim
    g = torch.Generator().manual_seed(6)
    B, T, N, K = 2, 6, 20, 12
    q = _randn(g, B, T, H, D)
    kv = _randn(g, B, N, D)
    indices = np.empty((B, T, K), np.int64)
    for b in range(B):
        for t in range(T):
            indices[b, t] = torch.randperm(N, generator=g)[:K].numpy()
    drop = torch.rand(B, T, K, generator=g).numpy() < 0.3
    indices[drop] = -1
    indices[0, 3] = -1  # no valid key at all
    indices[1, 5, :] = -1
    indices[1, 5, 7] = 11  # a single valid key in the middle of padding
    mask = np.full((B, 1, T, N), -np.inf, np.float32)
    for b in range(B):
        for t in range(T):
            mask[b, 0, t, indices[b, t][indices[b, t] >= 0]] = 0.0

    kv_t = kv[:, None]  # [B, 1, N, D]
    ref, _ = M.eager_attention_forward(mod, q.transpose(1, 2), kv_t, kv_t, torch.from_numpy(mask),
                                       scaling=mod.scaling)
    ours = sparse_attention_ref(_j(q), _j(kv), jnp.asarray(indices, jnp.int32), _j(mod.sinks), scale=D ** -0.5)
    assert ours.shape == ref.shape == (B, T, H, D)
    assert_close(ours, ref, 1e-5, "sparse attention")
    assert np.all(_n(ours)[0, 3] == 0.0)
    # the sink matters: without it the result differs
    no_sink = sparse_attention_ref(_j(q), _j(kv), jnp.asarray(indices, jnp.int32), jnp.full((H,), -1e30),
                                   scale=D ** -0.5)
    assert _rel_err(no_sink, ref) > 1e-2


# ---------------------------------------------------------------------------------------------
# 6. Grouped output projection
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "flash"])
@pytest.mark.parametrize("layer_type", ["none", "main", "compress"])
@torch.no_grad()
def test_grouped_output_projection(name, layer_type):
    """attention.output (the attention's output rotated back at the query position, then wo_a per
    group, then wo_b; o as `attention.attend` leaves it, at the queries' rotation) vs the tail of
    DeepseekV4Attention.forward:
    apply_rotary_pos_emb(o, cos, -sin), then DeepseekV4GroupedLinear (o_a_proj) and o_b_proj.
    "none" isolates the projection (cos = 1, sin = 0); "main"/"compress" use the rotary module's
    tables at random positions up to 1e6.

    Tolerance: 1e-5 relative: two fp32 matmuls (over H*Dh/G, up to 1024, and G*O inputs) after a
    rotation (observed <= 5e-7)."""
    hf_cfg = _hf_cfg(CONFIGS[name])
    cfg = _our_cfg(hf_cfg)
    mod = _randomized(M.DeepseekV4Attention(hf_cfg, 0), hf_cfg, seed=70)
    g = torch.Generator().manual_seed(7)
    B, S, H, D = 2, 5, cfg.num_heads, cfg.head_dim
    o = _randn(g, B, S, H, D)
    half = cfg.rope_head_dim // 2
    if layer_type == "none":
        cos_t, sin_t = torch.ones(B, S, half), torch.zeros(B, S, half)
    else:
        pos = torch.randint(0, 1_000_000, (B, S), generator=g)
        pos[0, 0], pos[0, 1] = 0, 100_000
        cos_t, sin_t = M.DeepseekV4RotaryEmbedding(hf_cfg)(o, position_ids=pos, layer_type=layer_type)

    # verbatim from DeepseekV4Attention.forward (attn_output there is [B, S, H, D])
    attn_output = M.apply_rotary_pos_emb(o.transpose(1, 2), cos_t, -sin_t).transpose(1, 2)
    grouped = attn_output.reshape(B, S, cfg.o_groups, -1)
    grouped = mod.o_a_proj(grouped).flatten(2)
    ref = mod.o_b_proj(grouped)

    p = {"wo_a": _j(mod.o_a_proj.weight), "wo_b": _j(mod.o_b_proj.weight)}
    ours = ours_attn.output(p, _j(o), (_j(cos_t), _j(sin_t)), cfg)
    assert ours.shape == ref.shape == (B, S, cfg.hidden_size)
    assert_close(ours, ref, 1e-5, "grouped output projection")


# ---------------------------------------------------------------------------------------------
# 7. Routers
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def test_learned_router():
    """router_scores + learned_choice + route vs DeepseekV4TopKRouter: the expert SETS per token
    exactly (order may differ), the weights matched by expert id.

    Tolerance: 1e-6 relative on scores and weights: sqrt(softplus) of fp32 logits over D = 32
    inputs and a k = 2 renormalisation (observed ~1e-7). The selection-only bias must matter
    (it changes the choice of some tokens) and must not enter the weights."""
    hf_cfg = _hf_cfg(hf_oracle.TINY)
    cfg = _our_cfg(hf_cfg)
    router = _randomized(M.DeepseekV4TopKRouter(hf_cfg), hf_cfg, seed=80)
    g = torch.Generator().manual_seed(8)
    T, k = 64, cfg.num_experts_per_tok
    x = _randn(g, T, cfg.hidden_size)
    logits_t, weights_t, idx_t = router(x)

    scores = router_scores(_j(x), _j(router.weight))
    assert_close(scores, router.score_fn(logits_t), 1e-6, "router scores")
    experts = learned_choice(scores, _j(router.e_score_correction_bias), k)
    weights = route(scores, experts, cfg.routed_scaling_factor)

    e_ours, e_ref = np.sort(_n(experts), -1), np.sort(_n(idx_t), -1)
    np.testing.assert_array_equal(e_ours, e_ref)
    w_ours = np.take_along_axis(_n(weights), np.argsort(_n(experts), -1), -1)
    w_ref = np.take_along_axis(_n(weights_t), np.argsort(_n(idx_t), -1), -1)
    assert_close(w_ours, w_ref, 1e-6, "router weights")
    np.testing.assert_allclose(w_ours.sum(-1), cfg.routed_scaling_factor, rtol=1e-6)
    unbiased = np.sort(_n(learned_choice(scores, jnp.zeros(cfg.n_routed_experts), k)), -1)
    assert np.any(np.any(unbiased != e_ref, axis=-1)), "the correction bias never changed a choice"


@torch.no_grad()
def test_hash_router():
    """tid2eid lookup + route vs DeepseekV4HashRouter: the experts exactly, in table order;
    weights 1e-6 relative (as the learned router)."""
    hf_cfg = _hf_cfg(hf_oracle.TINY)
    cfg = _our_cfg(hf_cfg)
    router = _randomized(M.DeepseekV4HashRouter(hf_cfg), hf_cfg, seed=90)
    g = torch.Generator().manual_seed(9)
    T = 64
    x = _randn(g, T, cfg.hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    _, weights_t, idx_t = router(x, ids)

    tid2eid = jnp.asarray(_n(router.tid2eid), jnp.int32)
    experts = tid2eid[_j(ids)]
    np.testing.assert_array_equal(_n(experts), _n(idx_t))
    weights = route(router_scores(_j(x), _j(router.weight)), experts, cfg.routed_scaling_factor)
    assert_close(weights, weights_t, 1e-6, "hash router weights")


# ---------------------------------------------------------------------------------------------
# 8. Experts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,routing", [(3, "uniform"), (512, "uniform"), (512, "skewed")])
@torch.no_grad()
def test_experts(T, routing, monkeypatch):
    """routed_experts + shared_expert vs DeepseekV4Experts + DeepseekV4MLP with swiglu_limit 0.5
    (clamps active on both gate and up). Few tokens take the per-row path (block size 1), 512
    tokens over 8 experts the blocked path (block size > 1); "skewed" routing leaves some experts
    empty and others with counts that are not block multiples (padding rows).

    Tolerance: 1e-5 relative: fp32 matmuls over D = 32 and I = 16 inputs, the routing weight
    applied before (ours) or after (transformers) the down projection, a sum over k = 2 experts
    (observed ~1e-7)."""
    hf_cfg = _hf_cfg(hf_oracle.TINY)
    cfg = _our_cfg(hf_cfg)
    limit = cfg.swiglu_limit
    assert limit == 0.5
    experts_mod = _randomized(M.DeepseekV4Experts(hf_cfg), hf_cfg, seed=100 + T)
    shared_mod = _randomized(M.DeepseekV4MLP(hf_cfg), hf_cfg, seed=200 + T)
    E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(T)
    x = _randn(g, T, cfg.hidden_size, scale=1.5)
    if routing == "uniform":
        idx = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    else:  # experts 0 and 3 take most tokens, 5..7 none
        probs = torch.tensor([0.55, 0.05, 0.02, 0.35, 0.03, 0.0, 0.0, 0.0])
        first = torch.multinomial(probs, T, replacement=True, generator=g)
        second = (first + 1 + torch.randint(0, 4, (T,), generator=g)) % 5
        idx = torch.stack([first, second], -1)
        assert (idx[:, 0] != idx[:, 1]).all()
    w = torch.rand(T, k, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor

    b = xla_cpu.block_size(T * k, E)
    assert (b == 1) if T < 16 else (b > 1)
    counts = np.bincount(_n(idx).ravel(), minlength=E)
    if routing == "skewed":
        assert np.any(counts == 0) and np.any(counts % b != 0) and counts.max() > 2 * b

    routed_t = experts_mod(x, idx, w)
    shared_t = shared_mod(x)

    gu = experts_mod.gate_up_proj
    w1, w3, w2 = _j(gu[:, :I]), _j(gu[:, I:]), _j(experts_mod.down_proj)
    routed = _routed_experts(_j(x), jnp.asarray(_n(idx), jnp.int32), _j(w), w1, w2, w3, limit)
    shared = _shared_expert(_j(x), _j(shared_mod.gate_proj.weight), _j(shared_mod.down_proj.weight),
                            _j(shared_mod.up_proj.weight), limit)
    assert_close(routed, routed_t, 1e-5, "routed experts")
    # the model's form: the same experts as layer 1 of stacks [3, E, ...], read by layer index
    stack = [jnp.stack([jnp.roll(wi, 1, axis=0), wi, -wi]) for wi in (w1, w2, w3)]
    stacked = jax.jit(routed_experts, static_argnums=(6,))(_j(x), jnp.asarray(_n(idx), jnp.int32), _j(w), *stack,
                                                           limit, jnp.int32(1))
    assert_close(stacked, routed_t, 1e-5, "routed experts read from layer stacks")
    # CPU generate's form: one buffer per (layer, expert) (unstack_layers), each read in place;
    # few tokens run each (token, slot) pair as a one-row FFN, many tokens the blocks
    monkeypatch.setattr(layer_weights, "MIN_ELEMENTS", 0)
    split = layer_weights.unstack_layers({"layers": {"ffn": dict(zip(("w1", "w2", "w3"), stack))}})["layers"]["ffn"]
    assert all(isinstance(split[n], layer_weights.PerExpert) for n in ("w1", "w2", "w3"))

    @partial(jax.jit, static_argnums=(5,))
    def in_place(x, idx, w, split, i, impl="auto"):
        layer = layer_weights.take_layer(split, i)
        return routed_experts(x, idx, w, layer["w1"], layer["w2"], layer["w3"], limit, impl=impl)

    for impl in ("auto", "ref"):  # "ref" (the plain-JAX form fine-tuning takes) reads these buffers as they are
        assert_close(in_place(_j(x), jnp.asarray(_n(idx), jnp.int32), _j(w), split, jnp.int32(1), impl), routed_t,
                     1e-5, f"routed experts from per-expert buffers, impl {impl}")
    # "ref" on the stacks: the grouped form on every platform, differentiable
    ref = jax.jit(partial(routed_experts, limit=limit, impl="ref"))(_j(x), jnp.asarray(_n(idx), jnp.int32), _j(w),
                                                                    *stack, layer=jnp.int32(1))
    assert_close(ref, routed_t, 1e-5, "routed experts, impl ref")
    grad = jax.grad(lambda x: jnp.sum(routed_experts(x, jnp.asarray(_n(idx), jnp.int32), _j(w), w1, w2, w3, limit,
                                                     impl="ref")))(_j(x))
    assert np.all(np.isfinite(_n(grad))) and np.any(_n(grad) != 0)
    # TPU's form (moe._grouped: the pairs' rows grouped by expert for
    # pallas_kernels.grouped_matmul, here its reference): plain, from the layer stacks, and with
    # the experts split over two devices (each runs its own half, the sum is the whole)
    grouped = jax.jit(partial(moe._grouped, limit=limit))
    args = (_j(x), jnp.asarray(_n(idx), jnp.int32), _j(w))
    assert_close(grouped(*args, w1, w2, w3), routed_t, 1e-5, "grouped routed experts")
    assert_close(grouped(*args, *stack, layer=jnp.int32(1)), routed_t, 1e-5, "grouped, from layer stacks")
    halves = [grouped(*args, *(wi[e0:e0 + E // 2] for wi in (w1, w2, w3)), first_expert=jnp.int32(e0))
              for e0 in (0, E // 2)]
    assert_close(_n(halves[0]) + _n(halves[1]), routed_t, 1e-5, "grouped, experts over two devices")
    assert_close(shared, shared_t, 1e-5, "shared expert")
    assert_close(_n(routed) + _n(shared), routed_t + shared_t, 1e-5, "routed + shared")

    # the clamps are active: pre-activations beyond the limit on both sides, and turning the
    # clamp off changes the result
    h = torch.einsum("td,eid->tei", x, gu)
    gate_pre = torch.gather(h[..., :I], 1, idx[..., None].expand(-1, -1, I))
    up_pre = torch.gather(h[..., I:], 1, idx[..., None].expand(-1, -1, I))
    assert (gate_pre > limit).any() and (up_pre > limit).any() and (up_pre < -limit).any()
    sh_gate, sh_up = shared_mod.gate_proj(x), shared_mod.up_proj(x)
    assert (sh_gate > limit).any() and (sh_up.abs() > limit).any()
    unclamped = _routed_experts(_j(x), jnp.asarray(_n(idx), jnp.int32), _j(w), w1, w2, w3, 0.0)
    assert _rel_err(unclamped, routed_t) > 1e-2


@pytest.mark.parametrize("rows, out, inp, halves", [(1, 512, 512, True), (2, 1024, 256, True), (1, 4096, 256, False),
                                                  (64, 512, 512, False), (1, 128, 512, False)])
def test_dense_in_halves(rows, out, inp, halves):
    """On CPU a projection of a few rows by a mid-sized weight runs as two half-weight products
    batched (xla_cpu.in_halves; decode's speed): the same values as one product, and only where
    meant. Tolerance 1e-6 relative: the same fp32 dot products over `inp` inputs, grouped
    differently by the matmul library (observed ~1e-7)."""
    g = np.random.default_rng(rows + out)
    x = jnp.asarray(g.standard_normal((rows, 3, inp)), jnp.float32)[:, :1]
    w = jnp.asarray(g.standard_normal((out, inp)), jnp.float32)
    assert xla_cpu.in_halves(x, w) == halves
    y = jax.jit(dense)(x, w)
    ref = np.einsum("rti,oi->rto", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert y.shape == (rows, 1, out)
    assert_close(y, ref, 1e-6, "dense")


@pytest.mark.parametrize("fmt, out, inp", [("fp8", 256, 384), ("fp8", 128, 128), ("fp4", 64, 96), ("fp4", 256, 512)])
def test_quantized_matmul_by_blocks(fmt, out, inp):
    """QuantizedWeight.matmul, the TPU / GPU form of a quantized projection (dsv4_jax/model/linear.py:
    the weight kept in its scale blocks), against the dequantized weight's product: the same fp32
    products summed in another order, so 1e-5 relative to the largest output (observed ~1e-6);
    FP4 codes above 7 are negative, scales span 2^-9 .. 2^6. A weight the blocks do not divide
    is not blocked, and `dense` keeps the whole-weight product on CPU (bit for bit the
    dequantized checkpoint's, as tests/test_convert.py asserts)."""
    import ml_dtypes

    from dsv4_jax.model.quantized import QuantizedWeight

    g = np.random.default_rng(out + inp)
    if fmt == "fp8":
        values = jnp.asarray(g.standard_normal((out, inp)).astype(ml_dtypes.float8_e4m3fn))
        scale = jnp.asarray(2.0 ** g.integers(-9, 6, (out // 128, inp // 128)), jnp.float32)
    else:
        values = jnp.asarray(g.integers(0, 256, (out, inp // 2), dtype=np.uint8))
        scale = jnp.asarray(g.integers(118, 134, (out, inp // 32), dtype=np.uint8))
    w = QuantizedWeight(values, scale, fmt=fmt, dtype_name="float32")
    stacked = w.replace(values=w.values[None], scale=w.scale[None])
    assert w.blocked() and not stacked.blocked()
    for lead in ((1,), (3,), (2, 5)):
        x = jnp.asarray(g.standard_normal(lead + (inp,)), jnp.float32)
        want = np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w.dequantize(), np.float64))
        got = jax.jit(QuantizedWeight.matmul)(w, x)
        assert got.shape == lead + (out,) and got.dtype == jnp.float32
        assert_close(got, want, 1e-5, f"{fmt} matmul")
        np.testing.assert_array_equal(np.asarray(jax.jit(dense)(x, w)),
                                      np.asarray(jax.jit(dense)(x, w.dequantize())))
    ragged = QuantizedWeight(values[:, :-1], scale, fmt=fmt) if fmt == "fp4" else \
        QuantizedWeight(values[:100], scale, fmt=fmt)
    assert not ragged.blocked()


@pytest.mark.parametrize("n_rows, K, in_use", [(40, 4, 40), (300, 32, 300), (300, 32, 150), (80, 4, 80), (1000, 4, 60)],
                         ids=["one tile", "tiles", "tiles, prefix in use", "gathered", "large pool, prefix in use"])
@pytest.mark.parametrize("p0", [(0, 0), (37, 5)], ids=["at 0", "rows at 37 and 5"])
def test_chunk_attention_equals_the_indexed_form(n_rows, K, in_use, p0):
    """attention._window_blocked (a prefill chunk on CPU) against the one-index-row reference
    (pallas_kernels.sparse_attention_ref over [ring | chunk | compressed rows]). The compressed
    part takes the masked products over tiles of 128 rows while the rows in use (up to the
    highest chosen) are at most 16 x top-k, else each query's rows gathered ("gathered": 80 > 64
    rows in use). Rows in no used tile are NaN: touching them would show. fp32, 1e-5 relative to
    the largest output (the two sum in different orders). Each row at its own position p0[b]."""
    rng = np.random.default_rng(n_rows + in_use + p0[0])
    B, T, H, D, W = 2, 21, 3, 16, 8
    q, ring, kv = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, H, D), (B, W, D), (B, T, D)))
    comp = rng.standard_normal((B, n_rows, D)).astype(np.float32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    idx = np.stack([[rng.choice(in_use, K, replace=False) for _ in range(T)] for _ in range(B)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1  # some queries see fewer entries, a few none
    idx[0, 0] = -1
    idx[1, 1] = np.r_[in_use - 1, rng.choice(in_use - 1, K - 1, replace=False)]  # the highest row in use
    tiles_in_use = -(-in_use // ours_attn.COMPRESSED_TILE) * ours_attn.COMPRESSED_TILE
    comp[:, tiles_in_use:] = np.nan
    comp, idx = jnp.asarray(comp), jnp.asarray(idx)
    scale = D ** -0.5
    p0 = jnp.asarray(p0, jnp.int32)
    got = ours_attn._window_blocked(q, ring, kv, comp, idx, sink, p0, scale, W)
    window = ours_attn.window_indices(p0, T, W, W)
    every = jnp.concatenate([window, jnp.where(idx >= 0, idx + W + T, -1)], axis=-1)
    want = sparse_attention_ref(q, jnp.concatenate([ring, kv, jnp.nan_to_num(comp)], axis=1), every, sink,
                                scale=scale)
    np.testing.assert_allclose(_n(got), _n(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
