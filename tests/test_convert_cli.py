"""dsv4-convert as a user meets it: OUT_DIR never touches the checkpoint or a user's files, the
tokenizer and generation files travel with the conversion, OUT_DIR's mode follows the umask,
errors name the real directory, one summary line on success, and NaN / infinite weights warn."""

import hashlib
import json
import os
import re
import shutil
import stat

import jax
import numpy as np
import pytest
from hf_oracle import TINY

import dsv4_jax
from convert.cli import OUTPUT_ENTRIES, convert, main, nonfinite_counts
from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
from dsv4_jax.checkpoint.hf_files import generation_eos_ids
from dsv4_jax.checkpoint.names import checkpoint_layout
from dsv4_jax.checkpoint.safetensors_io import CheckpointError, iter_file, write_safetensors

CFG = dsv4_jax.ModelConfig.from_hf(TINY)
VOCAB = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}


def _write_tokenizer_files(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "model_max_length": 1024}, f)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, 3], "do_sample": False}, f)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A quantized official-naming checkpoint (2 shards) with a tokenizer and both configs."""
    d = tmp_path_factory.mktemp("hf") / "hf"
    write_hf_checkpoint(dsv4_jax.init_params(CFG, seed=1), CFG, str(d), num_shards=2, quantize=True)
    _write_tokenizer_files(str(d))
    return d


def _snapshot(root):
    """Every entry under root (symlinks not followed): relative path -> sha256 of a file's
    bytes, "dir", or the target of a symlink."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def _one_error(capsys, argv, pattern):
    assert main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv4-convert: error: ") and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    return err


# ---- item 1: OUT_DIR is never the checkpoint, inside it or around it; --overwrite replaces only
# a previous conversion -----------------------------------------------------------------------

# (HF_DIR, OUT_DIR, message) under the layout: p/hf (the checkpoint), p/notes.txt, alias -> p/hf,
# palias -> p (symlinks)
OVERLAPS = [
    ("p/hf", "p/hf", r"OUT_DIR p/hf is HF_DIR p/hf \(the same directory\): write the conversion to another"),
    ("p/hf", "alias", r"OUT_DIR alias is HF_DIR p/hf \(the same directory\)"),
    ("alias", "p/hf", r"OUT_DIR p/hf is HF_DIR alias \(the same directory\)"),
    ("p/hf", "p/hf/../hf", r"OUT_DIR p/hf/\.\./hf is HF_DIR p/hf \(the same directory\)"),
    ("p/hf", "palias/hf", r"OUT_DIR palias/hf is HF_DIR p/hf \(the same directory\)"),
    ("p/hf", "p", r"OUT_DIR p contains HF_DIR p/hf: write the conversion to a directory that does not hold"),
    ("p/hf", "palias", r"OUT_DIR palias contains HF_DIR p/hf"),
    ("alias", "p", r"OUT_DIR p contains HF_DIR alias"),
    ("p/hf", ".", r"OUT_DIR \. contains HF_DIR p/hf"),
    ("p/hf", "p/hf/out", r"OUT_DIR p/hf/out is inside HF_DIR p/hf: write the conversion outside the checkpoint"),
    ("p/hf", "alias/out", r"OUT_DIR alias/out is inside HF_DIR p/hf"),
    ("p/hf", "p/hf/config.json", r"OUT_DIR p/hf/config\.json is inside HF_DIR p/hf"),
    ("p/hf", "palias/hf/a/b", r"OUT_DIR palias/hf/a/b is inside HF_DIR p/hf"),
]


@pytest.mark.parametrize("src,out,message", OVERLAPS, ids=[f"{s}->{o}" for s, o, _ in OVERLAPS])
def test_out_dir_overlapping_the_checkpoint_is_refused(hf, tmp_path, capsys, monkeypatch, src, out, message):
    """With and without --overwrite: exit 1, one line saying why, and every byte under the test
    directory as it was (the checkpoint, p/notes.txt, the links; no directory added)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf, tmp_path / "p" / "hf")
    (tmp_path / "p" / "notes.txt").write_text("my notes")
    os.symlink(tmp_path / "p" / "hf", tmp_path / "alias")
    os.symlink(tmp_path / "p", tmp_path / "palias")
    before = _snapshot(tmp_path)
    assert before["p/notes.txt"] != "dir" and before["p/hf/model-00001-of-00002.safetensors"] != "dir"
    for extra in ([], ["--overwrite"]):
        _one_error(capsys, [src, out, *extra], message)
        assert _snapshot(tmp_path) == before


def test_overwrite_replaces_only_a_previous_conversion(hf, tmp_path, capsys):
    """--overwrite on a directory that is not a conversion (user files; an HF checkpoint, whose
    config.json has no "dsv4_jax"; a conversion look-alike missing params/), or on a conversion
    holding a file a conversion does not write, is refused and nothing changes; a previous
    conversion is replaced, the directories next to it untouched; an empty OUT_DIR needs no
    --overwrite."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub").mkdir()
    (mine / "sub" / "data.bin").write_bytes(b"\x00\x01")
    other_hf = tmp_path / "other_hf"
    shutil.copytree(hf, other_hf)
    lookalike = tmp_path / "lookalike"
    lookalike.mkdir()
    (lookalike / "config.json").write_text(json.dumps({"dsv4_jax": CFG.to_dict()}))
    converted = tmp_path / "converted"
    assert main([str(hf), str(converted), "--layers", "1"]) == 0
    (converted / "notes.txt").write_text("added by the user")
    capsys.readouterr()
    before = _snapshot(tmp_path)
    for out, message in ((mine, r"mine is not a dsv4-convert output .*--overwrite only replaces a previous"),
                         (other_hf, r"other_hf is not a dsv4-convert output"),
                         (lookalike, r"lookalike is not a dsv4-convert output"),
                         (converted, r"converted holds files a conversion does not write \(notes\.txt\); "
                                     r"--overwrite would delete them")):
        _one_error(capsys, [hf, out, "--overwrite"], message)
        _one_error(capsys, [hf, out], r"exists and is not empty \(pass --overwrite to replace a previous")
        assert _snapshot(tmp_path) == before
    # a previous conversion: replaced by the new one, its neighbours untouched
    (converted / "notes.txt").unlink()
    assert sorted(os.listdir(converted)) == sorted(e for e in OUTPUT_ENTRIES if e != "mtp")
    neighbours = {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith("converted")}
    assert main([str(hf), str(converted), "--layers", "2", "--overwrite"]) == 0
    assert json.loads((converted / "config.json").read_text())["layers_converted"] == 2
    assert {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith("converted")} == neighbours
    # an empty directory is filled without --overwrite
    (tmp_path / "empty").mkdir()
    assert main([str(hf), str(tmp_path / "empty"), "--layers", "1"]) == 0
    assert dsv4_jax.ModelConfig.from_hf(tmp_path / "empty").num_layers == 1


def test_symlinked_out_dir_replaces_its_target(hf, tmp_path):
    """OUT_DIR given as a symlink to a previous conversion: the conversion is replaced where it
    lies and the link still leads to it (replacing the link itself would leave the old one)."""
    real = tmp_path / "real"
    assert main([str(hf), str(real), "--layers", "1"]) == 0
    os.symlink(real, tmp_path / "link")
    assert main([str(hf), str(tmp_path / "link"), "--layers", "2", "--overwrite"]) == 0
    assert os.path.islink(tmp_path / "link")
    assert json.loads((real / "config.json").read_text())["layers_converted"] == 2
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


# ---- item 4: the tokenizer and generation files are copied ---------------------------------------

def test_tokenizer_and_generation_files_copied(hf, tmp_path):
    from tokenizers import Tokenizer

    src = tmp_path / "src"
    shutil.copytree(hf, src)
    # as in an HF hub cache: the file is a symlink to a blob; its contents are copied
    blob = tmp_path / "blob"
    shutil.move(src / "tokenizer.json", blob)
    os.symlink(blob, src / "tokenizer.json")
    out = tmp_path / "out"
    done = convert(str(src), str(out), layers=1)
    names = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert done.copied == names
    assert json.loads((out / "config.json").read_text())["copied_files"] == names
    for n in names:
        assert not os.path.islink(out / n)
        assert (out / n).read_bytes() == (src / n).read_bytes(), n
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("hello world").ids == [2, 3]
    assert generation_eos_ids(str(out), CFG.vocab_size) == (1, 3)
    # a checkpoint without them: nothing copied, nothing listed
    for n in names:
        (src / n).unlink()
    done = convert(str(src), str(tmp_path / "bare"), layers=1)
    assert done.copied == [] and json.loads((tmp_path / "bare" / "config.json").read_text())["copied_files"] == []
    assert sorted(os.listdir(tmp_path / "bare")) == ["config.json", "params"]


V = CFG.vocab_size
BAD_FILES = [
    ("tokenizer.json", "{not json", r"tokenizer\.json: not a valid tokenizer \(key must be a string"),
    ("tokenizer.json", "{}", r"tokenizer\.json: not a valid tokenizer"),
    ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: not a JSON object"),
    ("tokenizer_config.json", "{\"a\": ", r"tokenizer_config\.json: not valid JSON"),
    ("generation_config.json", "{\"eos_token_id\": \"</s>\"}",
     rf"generation_config\.json: eos_token_id must be a token id in \[0, {V}\) or a list of them, got '</s>'"),
    ("generation_config.json", f"{{\"eos_token_id\": [1, {V}]}}", rf"got \[1, {V}\]"),
    ("generation_config.json", "{\"eos_token_id\": true}", r"got True"),
]


@pytest.mark.parametrize("name,content,message", BAD_FILES, ids=[f"{n}:{c}" for n, c, _ in BAD_FILES])
def test_corrupt_tokenizer_or_generation_file_is_an_error(hf, tmp_path, capsys, name, content, message):
    src = tmp_path / "src"
    shutil.copytree(hf, src)
    (src / name).write_text(content)
    _one_error(capsys, [src, tmp_path / "out"], message)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_generation_eos_ids(tmp_path):
    assert generation_eos_ids(str(tmp_path)) == ()  # no file
    for value, want in ((7, (7,)), ([1, 2], (1, 2)), (None, ()), ([], ())):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert generation_eos_ids(str(tmp_path), V) == want
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0}))
    assert generation_eos_ids(str(tmp_path)) == ()
    for bad in (1.0, "1", [1, None], -1, False):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(CheckpointError, match="eos_token_id must be a token id or a list of them"):
            generation_eos_ids(str(tmp_path))


# ---- item 8: mode, unwritable parent, summary line, NaN / infinite weights -------------------------

@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_out_dir_mode_follows_the_umask(hf, tmp_path, umask):
    """OUT_DIR, the parents it creates and the files in it get the modes the umask gives (the
    temporary directory is not made with mkdtemp's 0700); a directory it replaces keeps its mode."""
    old = os.umask(umask)
    try:
        done = convert(str(hf), str(tmp_path / "a" / "b" / "out"), layers=1)
        (tmp_path / "kept").mkdir()
        os.chmod(tmp_path / "kept", 0o750)
        convert(str(hf), str(tmp_path / "kept"), layers=1)
    finally:
        os.umask(old)
    out = tmp_path / "a" / "b" / "out"
    assert done.out_dir == str(out)

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    for d in (tmp_path / "a", tmp_path / "a" / "b", out, out / "params", out / "params" / "embed"):
        assert mode(d) == 0o777 & ~umask, (d, oct(mode(d)))
    for f in (out / "config.json", out / "tokenizer.json", out / "generation_config.json",
              out / "params" / "_METADATA"):
        assert mode(f) == 0o666 & ~umask, (f, oct(mode(f)))
    assert mode(tmp_path / "kept") == 0o750


def test_unwritable_parent_is_named(hf, tmp_path, capsys):
    """The error names OUT_DIR (and a parent it failed to create), never the temporary
    directory. /sys takes no new entries from anyone, root included (root ignores permission
    bits, so a chmod-ed directory would not do)."""
    assert os.path.ismount("/sys")
    err = _one_error(capsys, [hf, "/sys/dsv4-convert-test-out"],
                     r"^dsv4-convert: error: cannot create /sys/dsv4-convert-test-out: "
                     r"(Permission denied|Operation not permitted|Read-only file system)$")
    assert ".tmp-" not in err
    _one_error(capsys, [hf, "/sys/dsv4-convert-test/a/out"],
               r"cannot create /sys/dsv4-convert-test/a/out: \w.*\(creating /sys/dsv4-convert-test\)$")
    assert not os.path.exists("/sys/dsv4-convert-test-out")


def test_failed_conversion_removes_the_parents_it_created(hf, tmp_path, capsys):
    """An error found only while streaming (an FP4 scale holding NaN) after OUT_DIR's missing
    parents were created: they are removed with the temporary directory."""
    src = tmp_path / "src"
    shutil.copytree(hf, src)
    _patch(src, "layers.0.ffn.experts.1.w2.scale", lambda a: _set_byte(a, 255))
    _one_error(capsys, [src, tmp_path / "new" / "deeper" / "out"],
               r"scale 'layers\.0\.ffn\.experts\.1\.w2\.scale' holds NaN")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def _chunk_bytes(out):
    """Bytes of the arrays' chunk files (uncompressed zarr v3: chunk files hold the data alone)."""
    total = 0
    for dirpath, _, files in os.walk(out):
        if f"{os.sep}c{os.sep}" in dirpath + os.sep:
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def test_one_summary_line_without_a_tty(hf, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main([str(hf), str(out), "--dtype", "native"]) == 0
    err = capsys.readouterr().err
    m = re.fullmatch(r"dsv4-convert: wrote (\S+) \((\d+) tensors, ([\d.]+ [KMG]?B), native, ([\d.]+) s\)\n", err)
    assert m, err
    assert m[1] == str(out)
    n_tensors = sum(1 for f in os.listdir(hf) if f.endswith(".safetensors")
                    for name, _ in iter_file(str(hf / f)) if not name.endswith(".scale"))
    assert int(m[2]) == n_tensors == len(checkpoint_layout(CFG))
    from convert.cli import _fmt_bytes

    assert m[3] == _fmt_bytes(_chunk_bytes(out))

    # on a TTY: the progress bar, then the same summary line
    class Tty:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    assert main([str(hf), str(out), "--overwrite"]) == 0
    bar, summary = tty.text.rsplit("\n", 2)[:2]
    assert f"{n_tensors}/{n_tensors} tensors" in bar and "MB/s" in bar
    assert re.fullmatch(rf"dsv4-convert: wrote {re.escape(str(out))} \({n_tensors} tensors, .*, bfloat16, .* s\)",
                        summary)


def _patch(src, name, fn):
    """Rewrites the shard holding tensor `name` with fn(its array) in its place."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    tensors = {n: np.array(a) for n, a in iter_file(str(shard))}
    tensors[name] = fn(tensors[name])
    write_safetensors(str(shard), tensors)


def _set_byte(a, byte):
    raw = a.view(np.uint8).copy()
    raw.flat[0] = byte
    return raw.view(a.dtype)


def test_nonfinite_weights_convert_with_one_warning_each(tmp_path, capsys):
    """NaN and infinite values are written as they are, with one warning line per tensor
    counting them as written: a float32 value beyond bfloat16's range (3.4e38) is finite in a
    float32 conversion and infinite in a bfloat16 one; an FP8 NaN code stays NaN kept quantized
    (native) and dequantized."""
    layout = checkpoint_layout(CFG)
    params = jax.tree.map(np.array, dsv4_jax.init_params(CFG, seed=2))

    def leaf(name):
        path, index = layout[name]
        a = params
        for k in path:
            a = a[k]
        return a[index] if index else a

    leaf("embed.weight")[0, :2] = np.nan
    leaf("embed.weight")[5, 3] = np.inf
    leaf("layers.1.attn.wq_a.weight")[0, :2] = [-np.inf, 3.4e38]
    leaf("layers.0.attn_norm.weight")[3] = np.nan
    src = tmp_path / "src"
    write_hf_checkpoint(params, CFG, str(src), dtype=np.float32)
    want = {"bfloat16": {"embed.weight": (2, 1), "layers.0.attn_norm.weight": (1, 0),
                         "layers.1.attn.wq_a.weight": (0, 2)},
            "float32": {"embed.weight": (2, 1), "layers.0.attn_norm.weight": (1, 0),
                        "layers.1.attn.wq_a.weight": (0, 1)}}
    for dtype, counts in want.items():
        out = tmp_path / dtype
        assert main([str(src), str(out), "--dtype", dtype, "--layers", "2"]) == 0
        lines = capsys.readouterr().err.splitlines()
        assert lines[-1].startswith(f"dsv4-convert: wrote {out} (")
        assert sorted(lines[:-1]) == sorted(
            f"dsv4-convert: warning: tensor {n!r} has {a} NaN and {b} infinite values (written as they are)"
            for n, (a, b) in counts.items())
        p = dsv4_jax.load(out).params
        embed = np.asarray(p["embed"], np.float32)
        assert np.isnan(embed[0, :2]).all() and embed[5, 3] == np.inf and np.isfinite(embed[1:5]).all()
        assert np.isnan(np.asarray(p["layers"]["attn_norm"][0, 3]))
    # an FP8 NaN code (0x7F) in a quantized checkpoint
    qsrc = tmp_path / "qsrc"
    write_hf_checkpoint(jax.tree.map(np.array, dsv4_jax.init_params(CFG, seed=3)), CFG, str(qsrc), quantize=True)
    tensors = {n: np.array(a) for n, a in iter_file(str(qsrc / "model.safetensors"))}
    tensors["layers.1.attn.wq_b.weight"] = _set_byte(tensors["layers.1.attn.wq_b.weight"], 0x7F)
    write_safetensors(str(qsrc / "model.safetensors"), tensors)
    for dtype in ("native", "bfloat16"):
        assert main([str(qsrc), str(tmp_path / f"q-{dtype}"), "--dtype", dtype, "--layers", "2"]) == 0
        lines = capsys.readouterr().err.splitlines()
        assert lines[:-1] == ["dsv4-convert: warning: tensor 'layers.1.attn.wq_b.weight' has 1 NaN and 0 "
                              "infinite values (written as they are)"], lines


def test_nonfinite_counts_in_blocks():
    import ml_dtypes

    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 11)).astype(np.float32)
    a.flat[[0, 4, 5, 40, 76]] = [np.nan, np.inf, -np.inf, np.nan, np.nan]
    for dt in (np.float32, ml_dtypes.bfloat16):
        for block in (1, 5, 16, 1 << 24):
            assert nonfinite_counts(a.astype(dt), block) == (3, 2)
    assert nonfinite_counts(np.arange(10)) == (0, 0)
