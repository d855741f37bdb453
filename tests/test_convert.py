"""dsv4-convert: exact FP8/FP4 dequantization, a quantized official checkpoint converted and
checked against transformers, and every bad input leaving no output behind."""

import json
import math
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_oracle import TINY

import dsv4_jax
from dsv4_jax.checkpoint import quant
from convert.cli import convert, main
from dsv4_jax.checkpoint.export_hf import official_config, official_tensors
from dsv4_jax.checkpoint.names import checkpoint_layout, mtp_checkpoint_layout
from dsv4_jax.checkpoint.safetensors_io import iter_file, write_safetensors
from dsv4_jax.model.mtp import mtp_param_spec
from dsv4_jax.tools.random_checkpoint import mtp_tensors
from dsv4_jax.model.quantized import QuantizedWeight

CFG = dsv4_jax.ModelConfig.from_hf(TINY)


# ---- (a) dequantization, bit for bit against a per-element decoding of the bit fields ---------

def _e4m3_ref(byte: int) -> float:
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def _e2m1_ref(code: int) -> float:
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = (m / 2) if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if s else v


def _e8m0_ref(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def _same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    np.testing.assert_array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])


def test_fp8_dequant_bit_exact():
    rng = np.random.default_rng(0)
    out, inp = 200, 300  # neither a multiple of 128
    raw = rng.integers(0, 256, (out, inp), dtype=np.uint8)
    raw[0, :256] = np.arange(256)  # every code, NaN included
    sraw = rng.integers(0, 255, fp8_shape := quant.fp8_scale_shape((out, inp)), dtype=np.uint8)
    sraw[0, 0], sraw[-1, -1] = 0, 254  # the extremes of E8M0
    with np.errstate(over="ignore"):  # 448 * 2^127 overflows float32 to inf, as it must
        got = quant.dequantize_fp8(raw.view(ml_dtypes.float8_e4m3fn), sraw.view(ml_dtypes.float8_e8m0fnu))
    ref = np.empty((out, inp), np.float64)
    for o in range(out):
        for i in range(inp):
            ref[o, i] = _e4m3_ref(int(raw[o, i])) * _e8m0_ref(int(sraw[o // 128, i // 128]))
    with np.errstate(over="ignore"):
        _same_bits(got, ref.astype(np.float32))
    assert fp8_shape == (2, 3)
    # bf16 target: one rounding of the exact value
    with np.errstate(over="ignore"):
        got16 = quant.dequantize_fp8(raw.view(ml_dtypes.float8_e4m3fn), sraw.view(ml_dtypes.float8_e8m0fnu),
                                     ml_dtypes.bfloat16)
        _same_bits(got16.astype(np.float32), ref.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32))
    # float32 scales (Flash-Base)
    fs = rng.uniform(0.001, 0.01, fp8_shape).astype(np.float32)
    got32 = quant.dequantize_fp8(raw.view(ml_dtypes.float8_e4m3fn), fs)
    ref32 = np.array([[np.float32(_e4m3_ref(int(raw[o, i]))) * fs[o // 128, i // 128] for i in range(inp)]
                      for o in range(out)], np.float32)
    _same_bits(got32, ref32)


def test_fp4_dequant_bit_exact():
    rng = np.random.default_rng(1)
    out, inp = 5, 96
    raw = rng.integers(0, 256, (out, inp // 2), dtype=np.uint8)
    raw[0, :16] = np.arange(16) | (np.arange(16)[::-1] << 4)
    sraw = rng.integers(100, 150, (out, inp // 32), dtype=np.uint8)
    got = quant.dequantize_fp4(raw.view(np.int8), sraw.view(ml_dtypes.float8_e8m0fnu))
    ref = np.empty((out, inp), np.float64)
    for o in range(out):
        for b in range(inp // 2):
            byte = int(raw[o, b])
            ref[o, 2 * b] = _e2m1_ref(byte & 0xF) * _e8m0_ref(int(sraw[o, (2 * b) // 32]))
            ref[o, 2 * b + 1] = _e2m1_ref(byte >> 4) * _e8m0_ref(int(sraw[o, (2 * b + 1) // 32]))
    _same_bits(got, ref.astype(np.float32))
    assert np.signbit(got[0, 16])  # code 8 (low nibble of byte 8) is -0
    # the nibble order, spelled out: byte 0x21 is [1 (code 2), 0.5 * ... ] -> low nibble first
    one = quant.dequantize_fp4(np.array([[0x21] + [0] * 15], np.uint8).view(np.int8),
                               np.full((1, 1), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu))
    assert one[0, 0] == 0.5 and one[0, 1] == 1.0


def test_quantizers():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((150, 260)) * np.exp(rng.uniform(-8, 8, (150, 1)))).astype(np.float32)
    q, s = quant.quantize_fp8(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (2, 3)
    d = quant.dequantize_fp8(q, s)
    # RNE on e4m3: relative error <= 2^-4 for normals; the scale is the smallest power of two fitting
    for bo in range(2):
        for bi in range(3):
            blk = w[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            sc = float(quant.scale_values(s)[bo, bi])
            assert np.abs(blk).max() <= 448 * sc and np.abs(blk).max() > 224 * sc
            np.testing.assert_array_equal(
                d[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128],
                (blk / sc).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * sc)
    w4 = (rng.standard_normal((7, 64)) * 3).astype(np.float32)
    w4[0, :8] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25]  # ties (scale 1 needs amax in (3, 6])
    w4[0, 8] = 6.0
    p, s4 = quant.quantize_fp4(w4)
    assert p.shape == (7, 32) and p.dtype == np.int8 and s4.shape == (7, 2)
    d4 = quant.dequantize_fp4(p, s4)
    sc = np.repeat(quant.scale_values(s4), 32, axis=1)
    np.testing.assert_array_equal(d4, (w4 / sc).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * sc)
    np.testing.assert_array_equal(d4[0, :8], [0, 1, 1, 2, 2, 4, 4, -0.0])
    # re-quantizing dequantized values is lossless
    q2, s2 = quant.quantize_fp4(d4)
    np.testing.assert_array_equal(quant.dequantize_fp4(q2, s2), d4)


# ---- (b) a quantized official checkpoint, converted, against transformers -----------------------

FP8_LEAVES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
              "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")
F32_KEPT = ("attn_sink", "ape", "bias")


def _is_fp8(name):
    return name.endswith(".weight") and any(f".{leaf}.weight" in name for leaf in FP8_LEAVES)


def _is_fp4(name):
    return ".ffn.experts." in name


def _published_form(name, arr):
    """(stored tensors, float32 reference values) for one tensor, as the published checkpoint stores it."""
    arr = np.asarray(arr)
    if arr.dtype.kind in "iu":
        return {name: arr.astype(np.int64)}, arr
    arr = arr.astype(np.float32)
    if _is_fp8(name):
        q, s = quant.quantize_fp8(arr)
        return {name: q, name[: -len(".weight")] + ".scale": s}, quant.dequantize_fp8(q, s)
    if _is_fp4(name):
        q, s = quant.quantize_fp4(arr)
        return {name: q, name[: -len(".weight")] + ".scale": s}, quant.dequantize_fp4(q, s)
    last = name.rsplit(".", 1)[-1]
    if last in F32_KEPT or last.startswith("hc_") or name.startswith("hc_"):
        return {name: arr}, arr
    b = arr.astype(ml_dtypes.bfloat16)
    return {name: b}, b.astype(np.float32)


def write_quantized_checkpoint(params, directory, num_shards=3, seed=0):
    """Official naming, FP8 linears and FP4 experts; returns {official name: float32 reference}."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(official_config(CFG), f)
    stored, ref = {}, {}
    items = []
    for name, (path, index) in checkpoint_layout(CFG).items():
        leaf = params
        for k in path:
            leaf = leaf[k]
        items.append((name, np.asarray(leaf[index] if index else leaf)))
    items += list(mtp_tensors(CFG, seed=seed).items())
    for name, arr in items:
        if name == "mtp.0.e_proj.weight":
            q, s = quant.quantize_fp8(arr.astype(np.float32))
            t, r = {name: q, "mtp.0.e_proj.scale": s}, quant.dequantize_fp8(q, s)
        else:
            t, r = _published_form(name, arr)
        stored.update(t)
        ref[name] = r
    names = list(stored)
    # round-robin over the shards: every scale lands in another shard than its weight
    weight_map = {}
    for s in range(num_shards):
        chunk = names[s::num_shards]
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        write_safetensors(os.path.join(directory, fname), {n: stored[n] for n in chunk})
        weight_map.update({n: fname for n in chunk})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return ref, weight_map


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    params = dsv4_jax.init_params(CFG, seed=7)
    d = tmp_path_factory.mktemp("hf_quant")
    ref, weight_map = write_quantized_checkpoint(params, str(d))
    return d, ref, weight_map


@pytest.fixture(scope="module")
def converted(quantized, tmp_path_factory):
    src = quantized[0]
    out = tmp_path_factory.mktemp("conv") / "out"
    assert main([str(src), str(out), "--dtype", "float32"]) == 0
    return out


def _hybrid(name):
    top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
           "hc_head_scale": "model.hc_head.hc_scale", "head.weight": "head.weight"}
    if name in top:
        return top[name]
    return "model." + name.replace(".attn.kv_norm.weight", ".attn.norm.weight")


def test_quantized_shards_split_weight_and_scale(quantized):
    _, _, weight_map = quantized
    split = [n for n in weight_map if n.endswith(".scale")
             and weight_map[n] != weight_map[n[: -len(".scale")] + ".weight"]]
    assert split, "the fixture should put some scale in another shard than its weight"
    assert any(v.startswith("model-00003") for v in weight_map.values())


def test_converted_params_equal_dequantized(converted, quantized):
    _, ref, _ = quantized
    cfg_json = json.loads((converted / "config.json").read_text())
    assert cfg_json["layers_converted"] == CFG.num_layers and cfg_json["dtype"] == "float32"
    assert dsv4_jax.ModelConfig.from_hf(converted) == CFG
    model = dsv4_jax.load(converted)
    for name, (path, index) in checkpoint_layout(CFG).items():
        leaf = model.params
        for k in path:
            leaf = leaf[k]
        got = np.asarray(leaf[index] if index else leaf)
        np.testing.assert_array_equal(got, ref[name].astype(got.dtype), err_msg=name)
    mtp = official_tensors(dsv4_jax.load_mtp_params(converted), CFG, mtp_block=True)
    assert sorted(mtp) == sorted(n for n in ref if n.startswith("mtp."))
    for n, a in mtp.items():
        np.testing.assert_array_equal(a, ref[n], err_msg=n)


def test_logits_match_transformers_on_dequantized_weights(converted, quantized, tmp_path):
    import torch
    from hf_oracle import hf_config
    from transformers import DeepseekV4ForCausalLM

    _, ref, _ = quantized
    hf_dir = tmp_path / "hf"
    hf_config(TINY).save_pretrained(str(hf_dir))
    write_safetensors(str(hf_dir / "model.safetensors"),
                      {_hybrid(n): np.ascontiguousarray(a) for n, a in ref.items() if not n.startswith("mtp.")})
    hf, info = DeepseekV4ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf.eval()
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 40))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids)).logits.float().numpy()
    got = np.asarray(dsv4_jax.load(converted)(ids))
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= tol, np.abs(got - want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_layers_prefix_bf16_and_overwrite(quantized, tmp_path):
    src, ref, _ = quantized
    out = tmp_path / "out"
    convert(str(src), str(out), dtype="bfloat16", layers=3)
    cfg = dsv4_jax.ModelConfig.from_hf(out)
    assert cfg.num_layers == 3 and cfg.compress_ratios == CFG.compress_ratios[:3]
    model = dsv4_jax.load(out, dtype=jnp.bfloat16)
    assert model.params["layers"]["attn"]["wq_a"].shape[0] == 3
    assert model.params["layers"]["ffn"]["w1"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(model.params["layers"]["ffn"]["w1"][2, 5], np.float32),
                                  ref["layers.2.ffn.experts.5.w1.weight"].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert model(np.arange(10)[None] % CFG.vocab_size).shape == (1, 10, CFG.vocab_size)
    # restored in float32 from a bf16 conversion; and onto an explicit sharding
    sh = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)),
                                    jax.sharding.PartitionSpec())
    m32 = dsv4_jax.load(out, sharding=sh)
    assert m32.params["layers"]["ffn"]["w1"].dtype == jnp.float32
    assert m32.params["embed"].sharding == sh
    # --overwrite replaces a complete conversion
    assert main([str(src), str(out), "--layers", "2", "--overwrite"]) == 0
    assert dsv4_jax.ModelConfig.from_hf(out).num_layers == 2
    assert [p for p in os.listdir(tmp_path) if p != "out"] == []


def test_load_quantized_hf_directly(quantized):
    src, ref, _ = quantized
    model = dsv4_jax.load(src)
    np.testing.assert_array_equal(np.asarray(model.params["layers"]["attn"]["wo_b"][4]),
                                  ref["layers.4.attn.wo_b.weight"])


# ---- (c) bad inputs: one message, non-zero exit, no OUT_DIR left ------------------------------

def _patch_shard(path, fn):
    """Rewrites one shard through fn(dict of tensors) -> dict."""
    tensors = {n: np.array(a) for n, a in iter_file(str(path))}
    write_safetensors(str(path), fn(tensors))


def _shard_of(src, name):
    return src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


def _drop(src, *names):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for n in names:
        _patch_shard(_shard_of(src, n), lambda t, n=n: {k: v for k, v in t.items() if k != n})
        del index["weight_map"][n]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _add(src, shard, name, arr):
    _patch_shard(src / shard, lambda t: {**t, name: arr})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _set_header_dtype(path, name, dtype):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[name]["dtype"] = dtype
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


SHARD2 = "model-00002-of-00003.safetensors"


def _break_missing_shard(src):
    (src / SHARD2).unlink()


def _break_truncated(src):
    data = (src / SHARD2).read_bytes()
    (src / SHARD2).write_bytes(data[: len(data) // 2])


def _break_header(src):
    data = bytearray((src / SHARD2).read_bytes())
    data[8:20] = b"{not json!!!"
    (src / SHARD2).write_bytes(bytes(data))


def _break_missing_tensor(src):
    _drop(src, "layers.3.attn.indexer.wq_b.weight", "layers.3.attn.indexer.wq_b.scale")


def _break_missing_scale(src):
    _drop(src, "layers.1.attn.wq_b.scale")


def _break_unexpected(src):
    _add(src, "model-00001-of-00003.safetensors", "layers.0.attn.compressor.ape", np.zeros((4, 64), np.float32))


def _break_shape(src):
    n = "layers.2.attn.compressor.wkv.weight"
    _patch_shard(_shard_of(src, n), lambda t: {**t, n: t[n][:-1]})


def _break_scale_shape(src):
    n = "layers.5.ffn.experts.3.w2.scale"
    _patch_shard(_shard_of(src, n), lambda t: {**t, n: t[n][:-1]})


def _break_dtype(src):
    _set_header_dtype(_shard_of(src, "hc_head_base"), "hc_head_base", "C64")


def _break_float_dtype_for_weight(src):
    n = "layers.0.attn_norm.weight"
    _patch_shard(_shard_of(src, n), lambda t: {**t, n: np.zeros(t[n].shape, np.int16)})


def _break_config(src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] = 48
    (src / "config.json").write_text(json.dumps(cfg))


BAD = [
    (_break_missing_shard, r"missing shard model-00002-of-00003\.safetensors"),
    (_break_truncated, r"model-00002-of-00003\.safetensors: (truncated|corrupt or truncated)"),
    (_break_header, r"model-00002-of-00003\.safetensors: corrupt"),
    (_break_missing_tensor, r"missing tensors \['layers\.3\.attn\.indexer\.wq_b\.weight'\]"),
    (_break_missing_scale, r"'layers\.1\.attn\.wq_b\.weight' is quantized \(F8_E4M3\) but has no scale"),
    (_break_unexpected, r"unexpected tensor 'layers\.0\.attn\.compressor\.ape'"),
    (_break_shape, r"'layers\.2\.attn\.compressor\.wkv\.weight' has shape \[31, 32\], the config expects \[32, 32\]"),
    (_break_scale_shape, r"scale 'layers\.5\.ffn\.experts\.3\.w2\.scale' has shape \[31, 1\]"),
    (_break_dtype, r"tensor 'hc_head_base' has unsupported dtype C64"),
    (_break_float_dtype_for_weight, r"'layers\.0\.attn_norm\.weight' has dtype I16, a float is expected"),
    (_break_config, r"has shape .*the config expects"),
]


@pytest.mark.parametrize("breaker,message", BAD, ids=[b.__name__[7:] for b, _ in BAD])
def test_bad_input(quantized, tmp_path, capsys, breaker, message):
    import re

    src = tmp_path / "src"
    shutil.copytree(quantized[0], src)
    breaker(src)
    out = tmp_path / "out"
    assert main([str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv4-convert: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no temporary directory left either


def test_non_empty_out_dir_needs_overwrite(quantized, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main([str(quantized[0]), str(out)]) == 1
    err = capsys.readouterr().err
    assert "is not empty (pass --overwrite" in err and str(out) in err
    assert os.listdir(out) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_python_dash_m(quantized, tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "convert", str(quantized[0]), str(tmp_path / "o"), "--layers", "0"],
                       cwd=root, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1 and "--layers must be in [1, 7], got 0" in r.stderr
    assert not (tmp_path / "o").exists()


def test_progress_only_on_a_tty():
    import io

    from convert.cli import _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = _Progress(stream)
        for i in range(1, 4):
            p(i, 3, i * 10**6)
    assert "3/3 tensors" in tty.getvalue() and "MB/s" in tty.getvalue()
    p = _Progress(Tty())
    p(1, 2, 5 * 10**6, 10 * 10**6)
    assert "1/2 tensors  5.0 MB/10.0 MB" in p.stream.getvalue() and "ETA" in p.stream.getvalue()
    assert pipe.getvalue() == ""


# ---- (d) --dtype native: quantized leaves kept, dequantized inside the matmuls ------------------

@pytest.fixture(scope="module")
def native(quantized, tmp_path_factory):
    src, _, _ = quantized
    out = tmp_path_factory.mktemp("native") / "out"
    assert main([str(src), str(out), "--dtype", "native"]) == 0
    return out


def test_native_keeps_quantized_leaves(native, converted):
    from dsv4_jax.model.mtp import NATIVE_QUANT as mtp_native_quant
    from dsv4_jax.model.params import NATIVE_QUANT
    from dsv4_jax.model.quantized import QuantizedWeight, dequantize_tree, is_quantized

    meta = json.loads((native / "config.json").read_text())
    assert meta["dtype"] == "native"
    assert meta["quantized"] == {".".join(p): f for p, f in NATIVE_QUANT.items()} | {
        "mtp." + ".".join(p): f for p, f in mtp_native_quant.items()
        if p != ("h_proj",)}  # the MTP block's under its state path; this source stores h_proj in bf16
    model = dsv4_jax.load(native)
    p = model.params
    w1, wq_b = p["layers"]["ffn"]["w1"], p["csa"]["indexer"]["wq_b"]
    assert isinstance(w1, QuantizedWeight) and w1.fmt == "fp4" and w1.values.dtype == jnp.uint8
    assert w1.shape == (CFG.num_layers, CFG.n_routed_experts, CFG.moe_intermediate_size, CFG.hidden_size)
    assert isinstance(wq_b, QuantizedWeight) and wq_b.fmt == "fp8" and wq_b.values.dtype == jnp.float8_e4m3fn
    assert not is_quantized(p["layers"]["attn"]["wo_a"]) and p["layers"]["attn"]["wo_a"].dtype == jnp.float32
    # dequantized, every leaf equals the float32 conversion bit for bit
    ref = dsv4_jax.load(converted).params
    for a, b in zip(jax.tree.leaves(dequantize_tree(p)), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # leading-axis slicing as the model does it: tree.map / dynamic index, expert gather, scan
    one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, 2, keepdims=False), p["layers"]["ffn"])
    np.testing.assert_array_equal(np.asarray(one["w2"][jnp.array([3, 1])].dequantize()),
                                  np.asarray(ref["layers"]["ffn"]["w2"][2][np.array([3, 1])]))
    _, ys = jax.lax.scan(lambda c, layer: (c, layer["w3"].dequantize()[0, 0, 0]), 0, p["layers"]["ffn"])
    np.testing.assert_array_equal(np.asarray(ys), np.asarray(ref["layers"]["ffn"]["w3"][:, 0, 0, 0]))
    with pytest.raises(IndexError):
        w1[0, 0, 0]


def test_native_logits_equal_dequantized(native, converted):
    """fp32 compute: the weights dequantize to the very float32 values the float32 conversion
    stores (e4m3/e2m1 times a power of two is exact in fp32), and the matmuls then run on
    identical operands, so the logits agree bit for bit (asserted within 1e-6 relative, the
    brief's bound); bf16 compute against the bf16 conversion likewise."""
    ids = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 40))
    want = np.asarray(dsv4_jax.load(converted)(ids))
    got = np.asarray(dsv4_jax.load(native)(ids))
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    np.testing.assert_array_equal(got, want)  # observed: identical
    m16 = dsv4_jax.load(native, dtype=jnp.bfloat16)
    assert m16.params["layers"]["ffn"]["w1"].dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(m16(ids))).all()


def test_native_decode_with_per_layer_weights(native, converted, monkeypatch):
    """The CPU decode loop splits the large weights into one buffer per layer, and the routed
    experts into one per (layer, expert) (dsv4_jax/model/layer_weights.py), QuantizedWeights included.
    With every weight split, with the experts left stacked, and with nothing split, greedy tokens
    from the native checkpoint equal those of the float32 conversion."""
    from dsv4_jax.model import layer_weights

    prompts = [list(map(int, np.random.default_rng(6).integers(0, CFG.vocab_size, n))) for n in (9, 30)]
    rows = {}
    for name, min_elements, max_experts in (("all", 0, 1024), ("stacked experts", 0, 0), ("none", 1 << 62, 1024)):
        monkeypatch.setattr(layer_weights, "MIN_ELEMENTS", min_elements)
        monkeypatch.setattr(layer_weights, "MAX_EXPERT_BUFFERS", max_experts)
        native_model = dsv4_jax.load(native)
        split = layer_weights.unstack_layers(native_model.params)
        w1, wkv = split["layers"]["ffn"]["w1"], split["layers"]["attn"]["wkv"]
        if name == "all":
            assert isinstance(w1, layer_weights.PerExpert) and isinstance(w1.parts[0], QuantizedWeight)
        else:
            assert isinstance(w1, QuantizedWeight)
        assert isinstance(wkv, layer_weights.PerLayer) == (name != "none")
        rows[name] = dsv4_jax.generate(native_model, prompts, 12).rows()
    rows["float32"] = dsv4_jax.generate(dsv4_jax.load(converted), prompts, 12).rows()
    assert rows["all"] == rows["stacked experts"] == rows["none"] == rows["float32"]


def test_native_mtp_and_float_source(native, quantized, tmp_path):
    _, ref, _ = quantized
    mtp = official_tensors(dsv4_jax.load_mtp_params(native), CFG, mtp_block=True)
    assert sorted(mtp) == sorted(n for n in ref if n.startswith("mtp."))
    for n, a in mtp.items():
        np.testing.assert_array_equal(a, ref[n], err_msg=n)
    # a float (unquantized) source stays float in native mode, in the dtype it is stored in
    from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
    from dsv4_jax.model.quantized import is_quantized

    src = tmp_path / "f32src"
    params = dsv4_jax.init_params(CFG, seed=3)
    write_hf_checkpoint(params, CFG, str(src), dtype=np.float32)
    convert(str(src), str(tmp_path / "o"), dtype="native", layers=2)
    m = dsv4_jax.load(tmp_path / "o")
    assert not any(is_quantized(x) for x in jax.tree.leaves(m.params, is_leaf=is_quantized))
    np.testing.assert_array_equal(np.asarray(m.params["layers"]["ffn"]["w1"]),
                                  np.asarray(params["layers"]["ffn"]["w1"][:2]))


def test_conversion_streams(quantized, tmp_path, monkeypatch):
    """The converter never builds the parameter tree: it writes each tensor as it is read."""
    from dsv4_jax.checkpoint import load_hf
    from dsv4_jax.checkpoint.store import CheckpointWriter

    def boom(*a, **k):
        raise AssertionError("read_hf_checkpoint must not be used by the converter")

    monkeypatch.setattr(load_hf, "read_hf_checkpoint", boom)
    writes, biggest = [], []
    orig = CheckpointWriter.write

    def spy(self, path, index, arr):
        writes.append(path)
        biggest.append(arr.nbytes)
        return orig(self, path, index, arr)

    monkeypatch.setattr(CheckpointWriter, "write", spy)
    convert(str(quantized[0]), str(tmp_path / "o"), dtype="bfloat16")
    layout = checkpoint_layout(CFG)
    assert len(writes) == len(layout) + len(mtp_checkpoint_layout(CFG))  # one write per tensor, MTP's too
    spec = dsv4_jax.param_spec(CFG)
    largest_slice = 0
    for path, index in layout.values():
        leaf = spec
        for k in path:
            leaf = leaf[k]
        largest_slice = max(largest_slice, 4 * math.prod(leaf[0][len(index):]))
    assert max(biggest) <= largest_slice  # one tensor (one layer / expert slice) per write


# ---- (e) OUT_DIR is an Orbax checkpoint: plain Orbax restores it ---------------------------------

def test_params_restore_with_plain_orbax(converted, native, quantized):
    """No dsv4_jax code: Orbax's own API lists and restores params/ and mtp/ (numpy arrays)."""
    import orbax.checkpoint as ocp

    src, ref, weight_map = quantized
    with ocp.PyTreeCheckpointer() as ckptr:
        listed = ckptr.metadata(str(converted / "params"))
        tree = ckptr.restore(str(converted / "params"))
        qtree = ckptr.restore(str(native / "params"))
        mtp = ckptr.restore(str(native / "mtp"))
    listed = getattr(getattr(listed, "item_metadata", listed), "tree", listed)
    assert listed["layers"]["ffn"]["w1"].shape == (CFG.num_layers, CFG.n_routed_experts,
                                                   CFG.moe_intermediate_size, CFG.hidden_size)
    assert isinstance(tree["embed"], np.ndarray) and tree["embed"].dtype == np.float32
    np.testing.assert_array_equal(tree["embed"], ref["embed.weight"])
    np.testing.assert_array_equal(tree["layers"]["attn"]["wo_b"][4], ref["layers.4.attn.wo_b.weight"])
    np.testing.assert_array_equal(tree["layers"]["ffn"]["w2"][3, 6], ref["layers.3.ffn.experts.6.w2.weight"])
    np.testing.assert_array_equal(tree["tid2eid"][0], ref["layers.0.ffn.gate.tid2eid"])
    # native: the quantized leaves are {values, scale} holding the source's stored bytes
    raw = {}
    for name in ("layers.2.ffn.experts.5.w1.weight", "layers.2.ffn.experts.5.w1.scale",
                 "layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale",
                 "mtp.0.ffn.experts.5.w1.weight", "mtp.0.ffn.experts.5.w1.scale"):
        raw[name] = dict(iter_file(str(src / weight_map[name])))[name]
    w1 = qtree["layers"]["ffn"]["w1"]
    assert sorted(w1) == ["scale", "values"]
    np.testing.assert_array_equal(w1["values"][2, 5], raw["layers.2.ffn.experts.5.w1.weight"].view(np.uint8))
    np.testing.assert_array_equal(w1["scale"][2, 5], raw["layers.2.ffn.experts.5.w1.scale"].view(np.uint8))
    wq_b = qtree["layers"]["attn"]["wq_b"]
    assert wq_b["values"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(wq_b["values"][1].view(np.uint8), raw["layers.1.attn.wq_b.weight"].view(np.uint8))
    np.testing.assert_array_equal(wq_b["scale"][1], raw["layers.1.attn.wq_b.scale"].astype(np.float32))
    # mtp/: the MTP block's tree (nnx.state(model.mtp)), experts stacked, quantized leaves as {values, scale}
    assert set(mtp) == set(mtp_param_spec(CFG))
    assert sorted(mtp["e_proj"]) == ["scale", "values"]
    np.testing.assert_array_equal(mtp["enorm"].astype(np.float32), ref["mtp.0.enorm.weight"])
    np.testing.assert_array_equal(mtp["ffn"]["w1"]["values"][5], raw["mtp.0.ffn.experts.5.w1.weight"].view(np.uint8))
    np.testing.assert_array_equal(mtp["ffn"]["w1"]["scale"][5], raw["mtp.0.ffn.experts.5.w1.scale"].view(np.uint8))
    assert "e_proj.values" in os.listdir(native / "mtp")
    assert not (converted / "params" / "index.json").exists()


def test_restore_onto_named_sharding(native, converted):
    """Plain Orbax onto a NamedSharding (cast to bf16 on the way), and dsv4_jax.load likewise."""
    import orbax.checkpoint as ocp

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    d = str(converted / "params")
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(d)
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(
        m.shape, jnp.bfloat16 if m.dtype == jnp.float32 else m.dtype, sharding=sh), meta)
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(d, target)
    w2 = tree["layers"]["ffn"]["w2"]
    assert isinstance(w2, jax.Array) and w2.sharding == sh and w2.dtype == jnp.bfloat16
    want = dsv4_jax.load(converted).params["layers"]["ffn"]["w2"]
    np.testing.assert_array_equal(np.asarray(w2, np.float32),
                                  np.asarray(want).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert tree["tid2eid"].dtype == jnp.int32
    # through dsv4_jax.load: quantized leaves' values and scales land on the sharding too
    p = dsv4_jax.load(native, sharding=sh).params
    assert p["layers"]["ffn"]["w1"].values.sharding == sh and p["layers"]["ffn"]["w1"].scale.sharding == sh
    assert p["embed"].sharding == sh


_MESH_SCRIPT = """
import sys
import jax, numpy as np, dsv4_jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("expert",))
n = len(jax.devices())
asked = []

def place(name, shape):  # the routed experts split along their expert axis, the rest replicated
    asked.append(name)
    if name.startswith(("layers.ffn.w1", "layers.ffn.w2", "layers.ffn.w3")):
        return NamedSharding(mesh, P(None, "expert"))
    return NamedSharding(mesh, P())

ids = np.random.default_rng(3).integers(0, int(sys.argv[3]), (2, 20))
for path in sys.argv[1:3]:
    asked.clear()
    model = dsv4_jax.load(path, sharding=place)
    w1 = model.params["layers"]["ffn"]["w1"]
    for arr in ((w1.values, w1.scale) if hasattr(w1, "values") else (w1,)):
        shards = arr.addressable_shards
        assert len(shards) == n and len({s.device for s in shards}) == n
        assert all(s.data.shape[1] == arr.shape[1] // n for s in shards), [s.data.shape for s in shards]
    assert model.params["embed"].sharding.is_fully_replicated
    assert "layers.attn.wq_a" in asked or "layers.attn.wq_a.values" in asked
    got, want = np.asarray(model(ids)), np.asarray(dsv4_jax.load(path)(ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
print("sharded ok", n)
"""


def test_load_onto_a_four_device_mesh(native, converted):
    """load(..., sharding=fn) on 4 (host) devices, in a child process (the device count is fixed
    when jax starts): the routed experts, quantized (values and scales) and float, are split
    along the expert axis with each device holding its quarter, the rest replicated; logits
    equal the single-device load's within 1e-5 relative (a sharded computation may sum in
    another order)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(native), str(converted), str(CFG.vocab_size)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sharded ok 4" in r.stdout


def test_misshapen_converted_leaf_is_an_error(converted, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(converted, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dsv4_jax"]["n_routed_experts"] += 1
    cfg["dsv4_jax"]["num_experts_per_tok"] = min(cfg["dsv4_jax"]["num_experts_per_tok"], 2)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"array 'layers\.ffn\.gate' is \[.*\], the config expects"):
        dsv4_jax.load(out)


def test_orbax_saved_checkpoint_loads(converted, tmp_path):
    """Any Orbax PyTree checkpoint of the tree loads (e.g. one Orbax itself saved, with OCDBT, as
    the earlier Orbax-based converter did), with its mtp tree."""
    import orbax.checkpoint as ocp

    out = tmp_path / "o"
    out.mkdir()
    shutil.copy(converted / "config.json", out / "config.json")
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore(str(converted / "params"))
        mtp = ckptr.restore(str(converted / "mtp"))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(str(out / "params"), tree)
        ckptr.save(str(out / "mtp"), mtp)
    got = dsv4_jax.load(out, dtype=jnp.bfloat16).params
    want = dsv4_jax.load(converted, dtype=jnp.bfloat16).params
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    m1, m2 = dsv4_jax.load_mtp_params(out), dsv4_jax.load_mtp_params(converted)
    assert jax.tree.structure(m1) == jax.tree.structure(m2)
    for a, b in zip(jax.tree.leaves(m1), jax.tree.leaves(m2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_all_zero_tensors_are_stored(quantized, tmp_path):
    """A tensor of zeros (an untrained sink, gate bias or `ape`) gets its chunk files like any
    other (tensorstore skips chunks equal to the fill value unless told not to), so the loader's
    damage check accepts the conversion and the zeros load back."""
    src = tmp_path / "src"
    shutil.copytree(quantized[0], src)
    name = "layers.0.attn.attn_sink"
    shard = _shard_of(src, name)
    _patch_shard(shard, lambda t: {**t, name: np.zeros_like(t[name])})
    out = tmp_path / "out"
    assert main([str(src), str(out), "--dtype", "float32"]) == 0
    model = dsv4_jax.load(out)
    assert not np.asarray(model.params["layers"]["attn"]["sink"])[0].any()
