"""dsv4_jax.tools.random_checkpoint: the checkpoint converts, loads and generates; its tokenizer round-trips
any text inside the vocabulary; the mtp.0.* tensors have architecture.md §10's shapes; the same
seed gives the same bytes; a user's directory is never written over."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import stderr_lines
from tokenizers import Tokenizer, pre_tokenizers

import dsv4_jax
from convert.cli import convert
from dsv4_jax.checkpoint.names import checkpoint_layout
from dsv4_jax.checkpoint.safetensors_io import scan_checkpoint
from dsv4_jax.tools import random_checkpoint as rc
from dsv4_jax.checkpoint.export_hf import official_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = {rc.BOS: 0, rc.EOS: 1, rc.USER: None, rc.ASSISTANT: None, rc.THINK: None, rc.END_THINK: None}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset with the mtp block, seed 0."""
    return rc.write_random_checkpoint(tmp_path_factory.mktemp("rc") / "tiny", "tiny", with_mtp=True, seed=0)


@pytest.fixture(scope="module")
def flash_mini(tmp_path_factory):
    """The flash-mini preset with the mtp block (written, never generated from here)."""
    return rc.write_random_checkpoint(tmp_path_factory.mktemp("rc") / "fm", "flash-mini", with_mtp=True, seed=3)


def _files(directory) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _logical(entries, name) -> tuple:
    """A weight's [out, in] shape as the model sees it (an FP4 tensor packs two inputs per byte)."""
    e = entries[name]
    return (e.shape[0], e.shape[1] * 2) if ".ffn.experts." in name else e.shape


def test_converts_loads_and_generates(tiny, tmp_path):
    hf_mtp = {n for n in scan_checkpoint(tiny) if n.startswith("mtp.") and not n.endswith(".scale")}
    out = tmp_path / "converted"
    convert(tiny, str(out))  # bfloat16 (its programs compile faster than a native one's)
    want = {"params", "mtp", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert want <= set(os.listdir(out))
    cfg = dsv4_jax.ModelConfig.from_hf(out)
    mtp = official_tensors(dsv4_jax.load_mtp_params(out), cfg, mtp_block=True)  # the block in mtp/
    assert set(mtp) == hf_mtp
    entries = scan_checkpoint(tiny)
    for name, arr in mtp.items():
        assert tuple(arr.shape) == _logical(entries, name), name

    model = dsv4_jax.load(out)
    cfg = model.config
    assert (cfg.num_nextn_predict_layers, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (1, 512, 0, 1)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tok.encode("Hello, 世界").ids
    res = dsv4_jax.generate(model, [prompt], 6, eos_token_id=None)
    row = res.rows()[0]
    assert len(row) == 6 and all(0 <= t < cfg.vocab_size for t in row)
    assert isinstance(tok.decode(row), str)  # every id the model can emit decodes


def test_byte_chars_are_the_byte_level_alphabet():
    chars = rc.byte_chars()
    assert len(set(chars)) == 256 and set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    assert chars[ord("A")] == "A" and chars[ord(" ")] == "Ġ"


def _texts():
    rng = np.random.default_rng(7)
    # random code points from every plane in use (no surrogates, which no UTF-8 text holds)
    pool = np.concatenate([rng.integers(0x20, 0x7F, 40), rng.integers(0xA0, 0xD7FF, 40),
                           rng.integers(0xE000, 0xFFFD, 20), rng.integers(0x10000, 0x10FFFF, 20)])
    return ["The quick brown fox jumps over the lazy dog.\n",
            "  leading and trailing spaces, tabs\tand\r\nnewlines  ",
            "日本語のテキストと中文文本",
            "emoji 😀👩🏽‍🚀🇫🇷 and ü n ï c ö d é (combining: e\u0301)",
            "\x00\x01\x7f control bytes",
            "".join(map(chr, rng.permutation(pool)))]


@pytest.mark.parametrize("preset", ["tiny", "flash-mini"])
def test_tokenizer_round_trips_any_text_inside_the_vocabulary(preset, tiny, flash_mini):
    from transformers import AutoTokenizer

    path = tiny if preset == "tiny" else flash_mini
    vocab = rc.PRESETS[preset][0].vocab_size
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert tok.get_vocab_size() == vocab
    hf_tok = AutoTokenizer.from_pretrained(path)  # what OpenAI-API servers load
    for text in _texts():
        ids = tok.encode(text).ids
        assert ids[0] == rc.BOS_ID and all(0 <= i < vocab for i in ids), text
        assert tok.decode(ids) == text
        assert hf_tok.encode(text) == ids and hf_tok.decode(ids, skip_special_tokens=True) == text
    merged = [t for t, i in tok.get_vocab().items() if rc.FIRST_BYTE_ID + 256 <= i < vocab - 4]
    assert len(merged) == vocab - rc.MIN_VOCAB and all(len(t) > 1 for t in merged)


def test_special_tokens_are_single_ids(tiny):
    tok = Tokenizer.from_file(os.path.join(tiny, "tokenizer.json"))
    vocab = 512
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    assert ids[rc.BOS] == 0 and ids[rc.EOS] == 1
    assert sorted(ids[t] for t in (rc.USER, rc.ASSISTANT, rc.THINK, rc.END_THINK)) == list(range(vocab - 4, vocab))
    for t, i in ids.items():
        assert tok.encode(t, add_special_tokens=False).ids == [i]
    chat = f"{rc.BOS}{rc.USER}hi{rc.ASSISTANT}{rc.THINK}ok{rc.END_THINK}yes{rc.EOS}"
    enc = tok.encode(chat, add_special_tokens=False).ids
    assert [i for i in enc if i in ids.values()] == [0, ids[rc.USER], ids[rc.ASSISTANT], ids[rc.THINK],
                                                     ids[rc.END_THINK], 1]
    with open(os.path.join(tiny, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(tiny, "generation_config.json")) as f:
        gen = json.load(f)
    with open(os.path.join(tiny, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1) == (gen["bos_token_id"], gen["eos_token_id"])
    assert (tcfg["bos_token"], tcfg["eos_token"]) == (rc.BOS, rc.EOS) and "chat_template" not in tcfg
    assert not os.path.exists(os.path.join(tiny, "chat_template.jinja"))


def test_mtp_tensors_have_the_documented_shapes(flash_mini):
    """architecture.md §10's tables, written for flash-mini's sizes: the block's own attention
    (window only: no compressor, no indexer), learned routing (gate bias, no tid2eid), FP8 e_proj /
    h_proj with 128x128 block scales, FP4 experts with per-32 scales, its hc head and norms."""
    with open(os.path.join(flash_mini, "config.json")) as f:
        config = json.load(f)
    assert config["num_nextn_predict_layers"] == 1
    assert config["compress_ratios"] == [0, 0, 4, 128, 4, 128, 4, 128, 0]
    D, H, Dh, Q, G, O, E, I, hc = 512, 8, 512, 256, 2, 256, 16, 256, 4
    M = (2 + hc) * hc

    def fp8(o, i):
        return {"weight": ((o, i), "F8_E4M3"), "scale": ((-(-o // 128), -(-i // 128)), "F8_E8M0")}

    def fp4(o, i):
        return {"weight": ((o, i // 2), "I8"), "scale": ((o, i // 32), "F8_E8M0")}

    want = {"attn_norm.weight": ((D,), "BF16"), "ffn_norm.weight": ((D,), "BF16"),
            "attn.attn_sink": ((H,), "F32"), "attn.q_norm.weight": ((Q,), "BF16"),
            "attn.kv_norm.weight": ((Dh,), "BF16"), "ffn.gate.weight": ((E, D), "BF16"),
            "ffn.gate.bias": ((E,), "F32"), "enorm.weight": ((D,), "BF16"), "hnorm.weight": ((D,), "BF16"),
            "norm.weight": ((D,), "BF16"), "hc_head_fn": ((hc, hc * D), "F32"), "hc_head_base": ((hc,), "F32"),
            "hc_head_scale": ((1,), "F32")}
    for site in ("attn", "ffn"):
        want.update({f"hc_{site}_fn": ((M, hc * D), "F32"), f"hc_{site}_base": ((M,), "F32"),
                     f"hc_{site}_scale": ((3,), "F32")})
    quantized = {"attn.wq_a": fp8(Q, D), "attn.wq_b": fp8(H * Dh, Q), "attn.wkv": fp8(Dh, D),
                 "attn.wo_a": fp8(G * O, H * Dh // G), "attn.wo_b": fp8(D, G * O),
                 "ffn.shared_experts.w1": fp8(I, D), "ffn.shared_experts.w3": fp8(I, D),
                 "ffn.shared_experts.w2": fp8(D, I), "e_proj": fp8(D, D), "h_proj": fp8(D, D)}
    for e in range(E):
        quantized.update({f"ffn.experts.{e}.w1": fp4(I, D), f"ffn.experts.{e}.w3": fp4(I, D),
                          f"ffn.experts.{e}.w2": fp4(D, I)})
    for base, parts in quantized.items():
        want.update({f"{base}.{k}": v for k, v in parts.items()})

    entries = scan_checkpoint(flash_mini)
    got = {n.removeprefix("mtp.0."): (e.shape, e.dtype) for n, e in entries.items() if n.startswith("mtp.")}
    assert got == want
    main = {n for n in entries if not n.startswith("mtp.")}
    cfg = rc.preset_config("flash-mini", with_mtp=True)
    assert {n for n in main if not n.endswith(".scale")} == set(checkpoint_layout(cfg))


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = rc.write_random_checkpoint(tmp_path / "again", "tiny", with_mtp=True, seed=0)
    assert _files(again) == _files(tiny)
    other = _files(rc.write_random_checkpoint(tmp_path / "other", "tiny", with_mtp=True, seed=1))
    base = _files(tiny)
    assert sorted(other) == sorted(base)
    differ = {n for n in base if other[n] != base[n]}
    assert {"tokenizer.json", "config.json"} <= differ  # merges and the recorded seed
    assert all(n in differ for n in base if n.endswith(".safetensors"))


def test_refuses_a_users_directory_and_leaves_nothing_behind(tmp_path, capsys):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(rc.RandomCheckpointError, match="not empty"):
            rc.write_random_checkpoint(user, "tiny", overwrite=overwrite)
    assert os.listdir(user) == ["notes.txt"] and (user / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["user"]  # no temporary directory left

    for argv, message in [([str(user), "--preset", "tiny"], "is not empty"),
                          ([str(tmp_path / "x"), "--preset", "huge"], "unknown preset 'huge'"),
                          ([str(tmp_path / "x"), "--preset", "tiny", "--seed", "-1"], "seed must be an integer"),
                          ([str(tmp_path / "x"), "--preset", "tiny", "--seed", "one"], "invalid int value"),
                          ([str(tmp_path / "x")], "--preset"),
                          ([str(user / "notes.txt"), "--preset", "tiny"], "is not a directory"),
                          ([str(user / "notes.txt" / "sub"), "--preset", "tiny"], "notes.txt is not a directory")]:
        assert rc.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("random_checkpoint: error: ") and message in err, err
    assert sorted(os.listdir(tmp_path)) == ["user"] and os.listdir(user) == ["notes.txt"]
    with pytest.raises(rc.RandomCheckpointError, match="vocab_size >= 262"):
        rc.build_tokenizer(256)


def test_cli_writes_and_overwrite_replaces_only_a_random_checkpoint(tmp_path, capsys):
    target = tmp_path / "a" / "b" / "ckpt"  # missing parents are created
    cmd = [sys.executable, "-m", "dsv4_jax.tools.random_checkpoint", str(target), "--preset", "tiny"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert len(stderr_lines(r.stderr)) == 1 and f"wrote {target}" in r.stderr
    first = _files(target)
    assert rc.is_random_checkpoint(str(target)) and "mtp" not in str(scan_checkpoint(str(target)).keys())

    assert rc.main([str(target), "--preset", "tiny", "--seed", "5"]) == 1 and _files(target) == first
    assert rc.main([str(target), "--preset", "tiny", "--seed", "5", "--overwrite"]) == 0
    with open(target / "config.json") as f:
        assert json.load(f)[rc.MARKER] == {"preset": "tiny", "with_mtp": False, "seed": 5}
    assert _files(target) != first
    assert sorted(os.listdir(target.parent)) == ["ckpt"]  # the replaced one and the temporary are gone

    (target / "extra.txt").write_text("a user's file")  # no longer only ours: never replaced
    assert rc.main([str(target), "--preset", "tiny", "--overwrite"]) == 1
    assert "refusing" in capsys.readouterr().err and (target / "extra.txt").exists()
