"""dsv4_jax.load: both namings, sharded checkpoints, mtp tensors, and the errors on bad input."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_oracle import TINY

import dsv4_jax
from dsv4_jax.checkpoint.safetensors_io import CheckpointError
from dsv4_jax.checkpoint.names import checkpoint_layout, official_name
from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
from dsv4_jax.checkpoint.safetensors_io import iter_file, write_safetensors

CFG = dsv4_jax.ModelConfig.from_hf(TINY)


@pytest.fixture(scope="module")
def params():
    return dsv4_jax.init_params(CFG, seed=5)


@pytest.fixture()
def ckpt(tmp_path, params):
    write_hf_checkpoint(params, CFG, str(tmp_path), num_shards=3, dtype=np.float32)
    return tmp_path


def _rewrite(ckpt, fn):
    """Applies fn(dict of tensors) -> dict to every shard, keeping the index consistent."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {n: np.array(a) for n, a in iter_file(str(ckpt / shard))}
        tensors = fn(shard, tensors)
        write_safetensors(str(ckpt / shard), tensors)
        new_map.update({n: shard for n in tensors})
    index_path.write_text(json.dumps({"weight_map": new_map}))


def test_official_naming_sharded_roundtrip(ckpt, params):
    assert len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) == 3
    model = dsv4_jax.load(ckpt)
    for path in (("embed",), ("layers", "ffn", "w2"), ("csa", "indexer", "compressor", "ape"), ("tid2eid",),
                 ("gate_bias",), ("hca", "compressor", "wkv"), ("layers", "attn", "sink")):
        a, b = params, model.params
        for k in path:
            a, b = a[k], b[k]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_bf16_load(tmp_path, params):
    write_hf_checkpoint(params, CFG, str(tmp_path), dtype=ml_dtypes.bfloat16)
    model = dsv4_jax.load(tmp_path, dtype=jnp.bfloat16)
    assert model.params["layers"]["ffn"]["w1"].dtype == jnp.bfloat16
    assert model.params["layers"]["hc_ffn"]["fn"].dtype == jnp.float32  # stored fp32, kept fp32
    assert model.params["tid2eid"].dtype == jnp.int32
    out = model(np.arange(12).reshape(1, 12) % CFG.vocab_size)
    assert out.dtype == jnp.float32 and out.shape == (1, 12, CFG.vocab_size)


def test_product_tiles_at_load(tmp_path, params, monkeypatch):
    """On TPU v7, `load` moves the bf16 weight stacks XLA's own products read into (16, 128) tiles
    (`sharding.product_tiled`, docs/plan.md). This machine has no TPU v7, but its XLA takes tiled
    layouts as well: with (8, 8) tiles given for the CPU (TINY's matrices are smaller than 16 x
    128), load places exactly those stacks so, every other leaf in the default layout, and the
    model's programs take the arrays as they are: the logits equal the default layout's bit for
    bit, and greedy generation gives the same tokens."""
    from dsv4_jax.model import sharding

    write_hf_checkpoint(params, CFG, str(tmp_path), dtype=ml_dtypes.bfloat16)
    ids = np.arange(12).reshape(1, 12) % CFG.vocab_size
    default = dsv4_jax.load(tmp_path, dtype=jnp.bfloat16)
    monkeypatch.setattr(sharding, "_PRODUCT_TILES", {"cpu": ((8, 8),)})
    model = dsv4_jax.load(tmp_path, dtype=jnp.bfloat16)
    leaves = [(tuple(k.key for k in p), x) for p, x in jax.tree_util.tree_flatten_with_path(model.params)[0]]
    tiled = {p for p, x in leaves if x.format.layout.tiling == ((8, 8),)}
    # every bf16 stack but the grouped matmul kernel's operands (wo_a, the routed experts)
    assert tiled == {p for p, x in leaves if x.dtype == jnp.bfloat16 and p[0] in ("layers", "csa", "hca")
                     and p[-1] not in ("wo_a", "w1", "w2", "w3")}
    assert len(tiled) == 16 and all(not x.format.layout.tiling for p, x in leaves if p not in tiled)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(default(ids)))
    np.testing.assert_array_equal(dsv4_jax.generate(model, ids, 8).tokens, dsv4_jax.generate(default, ids, 8).tokens)
    # the buffer a stack came from is donated (load holds one stack twice at most, not the tree)
    stack, embed = jnp.ones((2, 16, 32), jnp.bfloat16), jnp.ones((96, 32), jnp.bfloat16)
    placed = sharding.product_tiled({"layers": {"attn": {"wq_a": stack}}, "embed": embed})
    assert stack.is_deleted() and placed["embed"] is embed and not embed.is_deleted()


def test_hybrid_naming_loads_the_same(ckpt, params):
    to_hybrid = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                 "hc_head_scale": "model.hc_head.hc_scale", "head.weight": "head.weight"}

    def rename(name):
        if name in to_hybrid:
            return to_hybrid[name]
        return "model." + name.replace(".attn.kv_norm.weight", ".attn.norm.weight")

    for n in checkpoint_layout(CFG):
        assert official_name(rename(n)) == n
    _rewrite(ckpt, lambda shard, t: {rename(n): a for n, a in t.items()})
    ids = np.arange(20).reshape(1, 20)
    np.testing.assert_array_equal(np.asarray(dsv4_jax.load(ckpt)(ids)),
                                  np.asarray(dsv4_jax.DeepseekV4(params, CFG)(ids)))


def test_mtp_tensors_are_recognised(ckpt, params):
    """The MTP block's tensors, added to the first shard of a checkpoint whose config has one:
    the main model loads as without them, `mtp=True` adds the block, read by its names."""
    from dsv4_jax.checkpoint.export_hf import official_tensors
    from dsv4_jax.tools.random_checkpoint import mtp_tensors

    extra = mtp_tensors(CFG, seed=1)
    _rewrite(ckpt, lambda shard, t: {**t, **extra} if shard.startswith("model-00001") else t)
    model = dsv4_jax.load(ckpt, mtp=True)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = official_tensors(model.mtp.params, CFG, mtp_block=True)
    assert set(got) == set(extra)
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, extra[name], err_msg=name)


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda s, t: {n: a for n, a in t.items() if n != "layers.3.attn.indexer.wq_b.weight"})
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers.3.attn.indexer.wq_b.weight'\]"):
        dsv4_jax.load(ckpt)


def test_unexpected_tensor(ckpt):
    _rewrite(ckpt, lambda s, t: {**t, "layers.0.attn.compressor.ape": np.zeros((4, 64), np.float32)}
             if s.startswith("model-00001") else t)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers.0.attn.compressor.ape'"):
        dsv4_jax.load(ckpt)


def test_misshapen_tensor(ckpt):
    def shrink(s, t):
        if "layers.2.attn.compressor.wkv.weight" in t:
            t["layers.2.attn.compressor.wkv.weight"] = t["layers.2.attn.compressor.wkv.weight"][:-1]
        return t
    _rewrite(ckpt, shrink)
    with pytest.raises(CheckpointError, match=r"'layers.2.attn.compressor.wkv.weight' has shape \[31, 32\], "
                                              r"the config expects \[32, 32\]"):
        dsv4_jax.load(ckpt)


def test_truncated_and_missing_shard(ckpt):
    shard = ckpt / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors: truncated file"):
        dsv4_jax.load(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing shard model-00002-of-00003.safetensors"):
        dsv4_jax.load(ckpt)


def test_quantized_weight_without_scale_is_an_error(ckpt):
    def quantize(s, t):
        if "layers.0.attn.wq_a.weight" in t:
            t["layers.0.attn.wq_a.weight"] = t["layers.0.attn.wq_a.weight"].astype(ml_dtypes.float8_e4m3fn)
        return t
    _rewrite(ckpt, quantize)
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.attn.wq_a.weight' is quantized \(F8_E4M3\) "
                                              r"but has no scale tensor"):
        dsv4_jax.load(ckpt)


def test_fp8_weight_with_scale_in_another_shard_loads(ckpt, params):
    from dsv4_jax.checkpoint.quant import dequantize_fp8, quantize_fp8

    q, sc = quantize_fp8(np.asarray(params["layers"]["attn"]["wq_a"][0], np.float32))

    def quantize(s, t):
        if "layers.0.attn.wq_a.weight" in t:
            t["layers.0.attn.wq_a.weight"] = q
        if s.startswith("model-00003"):
            t["layers.0.attn.wq_a.weight_scale_inv"] = sc  # the vLLM / HF-quantizer naming
        return t
    _rewrite(ckpt, quantize)
    model = dsv4_jax.load(ckpt)
    np.testing.assert_array_equal(np.asarray(model.params["layers"]["attn"]["wq_a"][0]), dequantize_fp8(q, sc))
