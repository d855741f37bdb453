"""The multi-token-prediction block (dsv4_jax/model/mtp.py) against a reference written from
architecture.md §9 in torch, loaded from checkpoints (HF, converted float32 and native), and the
main model's final hidden streams it takes (`step(..., return_hidden=True)`).

Tolerance, as the model parity tests: max |logit diff| <= 1e-4 * max(1, max |logit|), fp32 on
both sides (the same math up to summation order; observed about 1e-6), while any slip (a wrong
rope base, routing, stream mixing or window) moves logits by 1e-2 or more.
"""

from __future__ import annotations

import shutil

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M  # noqa: E402

import dsv4_jax  # noqa: E402
import hf_oracle as H  # noqa: E402
from convert.cli import convert  # noqa: E402
from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint  # noqa: E402
from dsv4_jax.checkpoint.safetensors_io import CheckpointError  # noqa: E402
from dsv4_jax.model import mtp  # noqa: E402
from dsv4_jax.model.cache import init_cache, put_rows, reset_rows, take_rows  # noqa: E402
from dsv4_jax.model.deepseek_v4 import lm_logits, step  # noqa: E402
from dsv4_jax.model.quantized import QuantizedWeight, dequantize_tree, is_quantized  # noqa: E402
from dsv4_jax.checkpoint.export_hf import official_tensors  # noqa: E402
from dsv4_jax.checkpoint.load_hf import read_source  # noqa: E402
from dsv4_jax.checkpoint.safetensors_io import scan_checkpoint  # noqa: E402
from dsv4_jax.tools.random_checkpoint import mtp_tensors  # noqa: E402

D_CFG = H.TINY  # window 8, hc 4, 8 experts top-2, swiglu limit 0.5
CFG = dsv4_jax.ModelConfig.from_hf(D_CFG)
W = CFG.sliding_window

_mtp_step = jax.jit(mtp.mtp_step, static_argnums=6)


def _close(ours, ref) -> bool:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape and np.isfinite(ours).all() and np.isfinite(ref).all()
    return np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


# ---- the reference ----------------------------------------------------------------------------

def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """§2.1: fp32 statistic, the weight multiplied before rounding (all fp32 here)."""
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Reference:
    """The MTP block of architecture.md §9 in torch, for whole sequences from position 0: the
    block is transformers' DeepseekV4DecoderLayer of a one-layer config whose layer is
    sliding-attention (rope "main": rope_theta, no YaRN) with learned routing (TopKRouter with
    its e_score_correction_bias); enorm / hnorm / e_proj / h_proj, the hc head (§4.3), the norm
    and the head are written here. Every parameter is random (hf_oracle.randomize's rules for
    the block: sinks, gate bias, hc base and scale non-trivial)."""

    def __init__(self, seed: int):
        d = dict(D_CFG, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0, num_nextn_predict_layers=0)
        self.cfg = H.hf_config(d)
        assert self.cfg.layer_types == ["sliding_attention"] and self.cfg.mlp_layer_types == ["moe"]
        torch.manual_seed(seed)
        self.block = M.DeepseekV4DecoderLayer(self.cfg, 0)
        holder = torch.nn.Module()
        holder.config, holder.block = self.cfg, self.block
        H.randomize(holder, seed)
        self.block.float().eval()
        for name, t in self.block.named_parameters():
            if name.endswith(("sinks", "e_score_correction_bias", "base")):
                assert t.abs().min() > 0, name
            if name.endswith("scale"):
                assert (t != 1).all(), name
        self.rotary = M.DeepseekV4RotaryEmbedding(self.cfg)
        g = torch.Generator().manual_seed(seed + 1)
        D, hc = CFG.hidden_size, CFG.hc_mult
        self.enorm = 1 + 0.2 * torch.randn(D, generator=g)
        self.hnorm = 1 + 0.2 * torch.randn(D, generator=g)
        self.e_proj = 0.15 * torch.randn(D, D, generator=g)
        self.h_proj = 0.15 * torch.randn(D, D, generator=g)
        self.norm = 1 + 0.2 * torch.randn(D, generator=g)
        self.hc_fn = 0.08 * torch.randn(hc, hc * D, generator=g)
        self.hc_base = 0.5 * torch.randn(hc, generator=g)
        self.hc_scale = 1 + 0.2 * torch.randn(1, generator=g)

    @torch.no_grad()
    def __call__(self, hidden, next_ids, embed, head):
        """hidden fp32 `[B, S, hc, D]` (positions 0 .. S-1), next_ids `[B, S]`, embed / head
        `[V, D]` -> (logits `[B, S, V]`, the block's output streams `[B, S, hc, D]`)."""
        hidden, ids = torch.tensor(np.asarray(hidden)), torch.tensor(np.asarray(next_ids), dtype=torch.long)
        embed, head = torch.tensor(np.asarray(embed)), torch.tensor(np.asarray(head))
        eps, (B, S) = CFG.rms_norm_eps, ids.shape
        e = _rms_norm(embed[ids], self.enorm, eps)
        h = _rms_norm(hidden, self.hnorm, eps)
        x = F.linear(e, self.e_proj)[:, :, None, :] + F.linear(h, self.h_proj)
        pos = torch.arange(S)[None].expand(B, S)
        t, s = pos[0][:, None], pos[0][None, :]
        mask = torch.where((s <= t) & (s > t - W), 0.0, -torch.inf)[None, None].expand(B, 1, S, S)
        streams = self.block(x, input_ids=ids, position_ids=pos, attention_mask=mask,
                             position_embeddings={"main": self.rotary(x, position_ids=pos, layer_type="main")})
        flat = streams.flatten(2)
        mix = F.linear(flat, self.hc_fn) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mix * self.hc_scale + self.hc_base) + CFG.hc_eps
        y = _rms_norm((pre[..., None] * streams).sum(2), self.norm, eps)
        return F.linear(y, head).numpy(), streams.numpy()

    def tensors(self) -> dict[str, np.ndarray]:
        """The block's weights by official checkpoint name (architecture.md §10.2 / §10.4: the
        HF module name of each `mtp.0.*` tensor)."""
        b, a, f = self.block, self.block.self_attn, self.block.mlp
        I = CFG.moe_intermediate_size
        t = {"attn_norm.weight": b.input_layernorm.weight, "ffn_norm.weight": b.post_attention_layernorm.weight,
             "attn.wq_a.weight": a.q_a_proj.weight, "attn.q_norm.weight": a.q_a_norm.weight,
             "attn.wq_b.weight": a.q_b_proj.weight, "attn.wkv.weight": a.kv_proj.weight,
             "attn.kv_norm.weight": a.kv_norm.weight, "attn.wo_a.weight": a.o_a_proj.weight,
             "attn.wo_b.weight": a.o_b_proj.weight, "attn.attn_sink": a.sinks,
             "ffn.gate.weight": f.gate.weight, "ffn.gate.bias": f.gate.e_score_correction_bias,
             "ffn.shared_experts.w1.weight": f.shared_experts.gate_proj.weight,
             "ffn.shared_experts.w3.weight": f.shared_experts.up_proj.weight,
             "ffn.shared_experts.w2.weight": f.shared_experts.down_proj.weight,
             "enorm.weight": self.enorm, "hnorm.weight": self.hnorm, "e_proj.weight": self.e_proj,
             "h_proj.weight": self.h_proj, "norm.weight": self.norm, "hc_head_fn": self.hc_fn,
             "hc_head_base": self.hc_base, "hc_head_scale": self.hc_scale}
        for site, mod in (("attn", b.attn_hc), ("ffn", b.ffn_hc)):
            t.update({f"hc_{site}_fn": mod.fn, f"hc_{site}_base": mod.base, f"hc_{site}_scale": mod.scale})
        for e in range(CFG.n_routed_experts):
            t[f"ffn.experts.{e}.w1.weight"] = f.experts.gate_up_proj[e, :I]
            t[f"ffn.experts.{e}.w3.weight"] = f.experts.gate_up_proj[e, I:]
            t[f"ffn.experts.{e}.w2.weight"] = f.experts.down_proj[e]
        return {"mtp.0." + k: v.detach().numpy().copy() for k, v in t.items()}


@pytest.fixture(scope="module")
def ref_pair(tmp_path_factory):
    """(reference, our block loaded from an HF checkpoint holding the reference's weights in
    float32 under their official names, the main model's embed and head)."""
    ref = Reference(seed=3)
    d = tmp_path_factory.mktemp("hf_mtp")
    write_hf_checkpoint(dsv4_jax.init_params(CFG, seed=4), CFG, str(d), dtype=np.float32, mtp=ref.tensors())
    main = dsv4_jax.load(d).params
    return ref, dsv4_jax.load_mtp_params(d), main["embed"], main["head"]


def _inputs(B: int, S: int, seed: int):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((B, S, CFG.hc_mult, CFG.hidden_size)).astype(np.float32)
    return hidden, rng.integers(0, CFG.vocab_size, (B, S)).astype(np.int32)


def test_prefill_chunk_equals_reference(ref_pair):
    """One chunk of 20 positions per row from position 0 (2.5 windows): logits and output
    streams equal the reference's; the routing bias matters (without it the logits differ)."""
    ref, params, embed, head = ref_pair
    hidden, ids = _inputs(2, 20, 0)
    want_logits, want_streams = ref(hidden, ids, embed, head)
    logits, streams, cache = _mtp_step(params, embed, head, mtp.init_mtp_cache(CFG, 2), jnp.asarray(hidden),
                                       jnp.asarray(ids), CFG)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 20, CFG.vocab_size)
    assert _close(logits, want_logits)
    assert _close(streams, want_streams)
    assert np.asarray(cache["pos"]).tolist() == [20, 20]
    unbiased = dict(params, ffn=dict(params["ffn"], gate_bias=jnp.zeros_like(params["ffn"]["gate_bias"])))
    other = _mtp_step(unbiased, embed, head, mtp.init_mtp_cache(CFG, 2), jnp.asarray(hidden), jnp.asarray(ids), CFG)
    assert not _close(other[0], want_logits)


def test_steps_at_per_row_positions_equal_reference(ref_pair):
    """Rows at different positions: a chunk of 11 (row 0 takes 3 of them, the rest padding), then
    single steps, row 1 holding (n_valid 0) once it is done; both rows cross the window (8) and
    wrap their ring token by token. Every position of every row equals the reference on the
    row's whole sequence, and the returned streams fed back as `hidden` are the next draft's
    input (a second step on them equals the reference run on the first one's streams)."""
    ref, params, embed, head = ref_pair
    S = 20
    hidden, ids = _inputs(2, S, 1)
    want_logits, want_streams = ref(hidden, ids, embed, head)
    rng = np.random.default_rng(2)
    cache = mtp.init_mtp_cache(CFG, 2)
    got = [[], []]
    got_streams = [[], []]
    for counts in [[3, 11]] + [[1, 1]] * 9 + [[1, 0]] * 8:
        T = max(counts)
        pos = np.asarray(cache["pos"])
        h, x = _inputs(2, T, int(rng.integers(1 << 30)))  # padding: random rows
        for b, n in enumerate(counts):
            h[b, :n], x[b, :n] = hidden[b, pos[b]:pos[b] + n], ids[b, pos[b]:pos[b] + n]
        logits, streams, cache = _mtp_step(params, embed, head, cache, jnp.asarray(h), jnp.asarray(x), CFG,
                                           jnp.asarray(counts, jnp.int32))
        for b, n in enumerate(counts):
            got[b].extend(np.asarray(logits)[b, :n])
            got_streams[b].extend(np.asarray(streams)[b, :n])
    assert np.asarray(cache["pos"]).tolist() == [S, S]
    for b in range(2):
        assert _close(np.stack(got[b]), want_logits[b]), f"row {b}"
        assert _close(np.stack(got_streams[b]), want_streams[b]), f"row {b}"
    # a second draft: the block again on its own output streams, with the next tokens
    ids2 = np.roll(ids, -1, axis=1)
    again = _mtp_step(params, embed, head, mtp.init_mtp_cache(CFG, 2), jnp.asarray(want_streams), jnp.asarray(ids2),
                      CFG)[0]
    assert _close(again, ref(want_streams, ids2, embed, head)[0])


def test_hidden_streams_of_step_equal_transformers(tmp_path):
    """`step(..., return_hidden=True)`: the final hidden streams before the hc head equal the
    output of transformers' last decoder layer at every position (also with last_only, which
    only narrows the logits), and the head on them gives the step's logits."""
    hf = H.make_model(D_CFG, seed=6)
    H.save(hf, D_CFG, str(tmp_path))
    params = dsv4_jax.load(tmp_path).params
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 13))
    seen = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda mod, args, out: seen.setdefault("h", out.detach()))
    H.logits(hf, ids)
    hook.remove()
    run = jax.jit(step, static_argnames=("cfg", "last_only", "return_hidden"))
    n = jnp.asarray([13, 6], jnp.int32)
    out = run(params, init_cache(CFG, 2, 16), jnp.asarray(ids), cfg=CFG, n_valid=n, return_hidden=True)
    logits, hidden = out.logits, out.hidden
    assert hidden.shape == (2, 13, CFG.hc_mult, CFG.hidden_size)
    assert _close(hidden[0], seen["h"][0].numpy()) and _close(hidden[1, :6], seen["h"][1, :6].numpy())
    assert _close(lm_logits(hidden, params["hc_head"], params["norm"], params["head"], CFG), logits)
    out = run(params, init_cache(CFG, 2, 16), jnp.asarray(ids), cfg=CFG, n_valid=n, last_only=True,
              return_hidden=True)
    last, hidden_last = out.logits, out.hidden
    assert last.shape == (2, 1, CFG.vocab_size) and hidden_last.shape == hidden.shape
    assert _close(hidden_last, hidden)
    assert _close(last[:, 0], np.asarray(logits)[[0, 1], [12, 5]])


# ---- loading ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An HF checkpoint in the published format (FP8 linears, e_proj / h_proj included, FP4
    experts; dsv4_jax.tools.random_checkpoint's MTP tensors) and its float32 and native conversions."""
    root = tmp_path_factory.mktemp("mtp_ckpt")
    hf = root / "hf"
    write_hf_checkpoint(dsv4_jax.init_params(CFG, seed=8), CFG, str(hf), num_shards=2, quantize=True,
                        mtp=mtp_tensors(CFG, seed=9))
    convert(str(hf), str(root / "f32"), dtype="float32")
    convert(str(hf), str(root / "native"), dtype="native")
    return hf, root / "f32", root / "native"


def test_native_conversion_gives_the_float32_logits(checkpoints):
    """A native conversion keeps e_proj / h_proj and the block's FP8 linears FP8 and its experts
    FP4 (wo_a dequantized, as in the main layers); dequantized they equal the float32
    conversion's weights bit for bit (e4m3 / e2m1 times a power of two is exact in fp32), and
    so do the block's logits (the matmuls see identical operands). The HF directory, read
    directly, gives the float32 conversion's tree too."""
    hf, f32, native = checkpoints
    ref = dsv4_jax.load_mtp_params(f32)
    got = dsv4_jax.load_mtp_params(native)
    quant = {path: type(x) for path, x in jax.tree_util.tree_flatten_with_path(got, is_leaf=is_quantized)[0]
             if is_quantized(x)}
    want = {tuple(jax.tree_util.DictKey(k) for k in p) for p in mtp.NATIVE_QUANT}
    assert set(quant) == want
    assert got["e_proj"].fmt == got["h_proj"].fmt == got["attn"]["wq_a"].fmt == "fp8"
    assert got["ffn"]["w1"].fmt == "fp4" and got["ffn"]["w1"].shape == ref["ffn"]["w1"].shape
    assert not is_quantized(got["attn"]["wo_a"]) and got["attn"]["wo_a"].dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(dequantize_tree(got)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(dsv4_jax.load_mtp_params(hf)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    main = dsv4_jax.load(f32).params
    hidden, ids = _inputs(2, 12, 4)
    args = (main["embed"], main["head"], mtp.init_mtp_cache(CFG, 2), jnp.asarray(hidden), jnp.asarray(ids), CFG)
    want_logits = np.asarray(_mtp_step(ref, *args)[0])
    got_logits = np.asarray(_mtp_step(got, *args)[0])
    assert np.abs(got_logits - want_logits).max() <= 1e-6 * np.abs(want_logits).max()
    # bf16 compute keeps the stored weights and takes bf16 as their compute dtype
    bf16 = dsv4_jax.load_mtp_params(native, dtype=jnp.bfloat16)
    assert isinstance(bf16["e_proj"], QuantizedWeight) and bf16["e_proj"].dtype == jnp.bfloat16
    assert bf16["hc_head"]["fn"].dtype == jnp.float32 and bf16["ffn"]["gate_bias"].dtype == jnp.float32


def test_tree_matches_the_checkpoint_names(checkpoints):
    """Every leaf comes from the tensor the checkpoint names for it (random_checkpoint's MTP
    tensors read back through the float32 conversion: e_proj / h_proj / linears FP8-rounded,
    experts FP4-rounded, the rest as written)."""
    hf, f32, _ = checkpoints
    by_name = official_tensors(dsv4_jax.load_mtp_params(f32), CFG, mtp_block=True)
    entries = scan_checkpoint(str(hf))
    assert set(by_name) == {n for n in entries if n.startswith("mtp.") and not n.endswith(".scale")}
    for name, arr in by_name.items():
        np.testing.assert_array_equal(arr, read_source(name, entries).dense(np.float32), err_msg=name)


def _hf_with(directory, tensors: dict) -> str:
    write_hf_checkpoint(dsv4_jax.init_params(CFG, seed=1), CFG, str(directory), dtype=np.float32, mtp=tensors or None)
    return str(directory)


@pytest.mark.parametrize("case, message", [
    ("none", "has no MTP tensors"),
    ("missing", r"missing MTP tensors \['mtp.0.hnorm.weight'\]"),
    ("misshapen", r"'mtp.0.e_proj.weight' has shape \[32, 33\], the config expects \[32, 32\]"),
    ("unexpected", r"unexpected MTP tensor 'mtp.0.ffn.gate.tid2eid'"),
    ("second block", r"unexpected MTP tensor 'mtp.1.enorm.weight'"),
    ("integer", r"'mtp.0.norm.weight' has dtype I64, a float is expected"),
])
def test_bad_checkpoints(case, message, tmp_path):
    """A bad MTP block is one error naming the tensor, from load_mtp_params, from load (the whole
    checkpoint is checked before anything is read) and from dsv4-convert (nothing written)."""
    tensors = mtp_tensors(CFG, seed=2)
    if case == "none":
        tensors = {}
    elif case == "missing":
        del tensors["mtp.0.hnorm.weight"]
    elif case == "misshapen":
        tensors["mtp.0.e_proj.weight"] = np.zeros((32, 33), np.float32)
    elif case == "unexpected":
        tensors["mtp.0.ffn.gate.tid2eid"] = np.zeros((CFG.vocab_size, 2), np.int64)
    elif case == "second block":
        tensors["mtp.1.enorm.weight"] = tensors["mtp.0.enorm.weight"]
    else:
        tensors["mtp.0.norm.weight"] = np.ones(CFG.hidden_size, np.int64)
    hf = _hf_with(tmp_path / "hf", tensors)
    with pytest.raises(CheckpointError, match=message):
        dsv4_jax.load_mtp_params(hf)
    if case == "none":
        return
    with pytest.raises(CheckpointError, match=message):
        dsv4_jax.load(hf)
    with pytest.raises(CheckpointError, match=message):
        convert(hf, str(tmp_path / "out"), dtype="float32")
    assert not (tmp_path / "out").exists()


def test_an_earlier_mtp_directory_says_convert_again(checkpoints, tmp_path):
    """An mtp/ by checkpoint names (what dsv4-convert wrote before the block's state tree) is one
    line saying to convert again; the main model in the same directory loads as before."""
    from dsv4_jax.checkpoint.store import CheckpointWriter

    _, f32, _ = checkpoints
    old = tmp_path / "old"
    shutil.copytree(f32, old)
    shutil.rmtree(old / "mtp")
    writer = CheckpointWriter(str(old / "mtp"))
    writer.create(("mtp", "0", "enorm", "weight"), "float", (CFG.hidden_size,), dtype=np.dtype(np.float32))
    writer.write(("mtp", "0", "enorm", "weight"), (), np.ones(CFG.hidden_size, np.float32))
    writer.close()
    with pytest.raises(CheckpointError, match=r"holds the MTP tensors by checkpoint name .*: convert it again$"):
        dsv4_jax.load(old, mtp=True)
    for a, b in zip(jax.tree.leaves(dsv4_jax.load(old).params), jax.tree.leaves(dsv4_jax.load(f32).params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_converted_without_mtp_is_an_error(tmp_path):
    convert(_hf_with(tmp_path / "hf", {}), str(tmp_path / "out"), dtype="float32")
    with pytest.raises(CheckpointError, match="has no MTP tensors"):
        dsv4_jax.load_mtp_params(tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        dsv4_jax.load_mtp_params(tmp_path / "nowhere")


def test_random_init_and_spec():
    """init_mtp_params follows mtp_param_spec, with nothing left trivial; the cache is the
    one-layer model's, so the engine's row operations (dsv4_jax.model.cache) apply to it."""
    spec = mtp.mtp_param_spec(CFG)
    params = mtp.init_mtp_params(CFG, seed=0, dtype=jnp.bfloat16)
    flat_spec = jax.tree_util.tree_flatten_with_path(spec, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                                                     and isinstance(x[1], str))[0]
    flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert len(flat) == len(flat_spec)
    for path, (shape, cls) in flat_spec:
        x = flat[path]
        assert x.shape == tuple(shape) and x.dtype == (jnp.bfloat16 if cls == "weight" else jnp.float32), path
        assert np.asarray(x, np.float32).std() > 0 or x.size == 1, path
    assert (np.asarray(params["ffn"]["gate_bias"]) != 0).all() and (np.asarray(params["attn"]["sink"]) != 0).all()
    cache = mtp.init_mtp_cache(CFG, 3)
    assert cache["pos"].shape == (3,) and cache["window"]["ring"].shape == (1, 3, W, CFG.head_dim)
    cache = {"pos": jnp.asarray([5, 6, 7], jnp.int32), "window": {"ring": jnp.arange(3.0)[None, :, None, None]
                                                                   * jnp.ones_like(cache["window"]["ring"])}}
    sub = take_rows(cache, jnp.asarray([2]))
    assert sub["pos"].tolist() == [7] and (np.asarray(sub["window"]["ring"]) == 2).all()
    back = put_rows(reset_rows(cache, jnp.asarray([False, True, False])), jnp.asarray([0]), sub)
    assert back["pos"].tolist() == [7, 0, 7] and (np.asarray(back["window"]["ring"])[0, :, 0, 0] == [2, 1, 2]).all()
