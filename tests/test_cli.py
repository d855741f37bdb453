"""dsv4-generate and a converted directory: damaged directories, tokenizer and generation config,
the persistent compilation cache; the other CLIs' checks that run before anything compiles."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import stderr_lines
from hf_oracle import TINY

import dsv4_jax
from dsv4_jax.checkpoint.safetensors_io import CheckpointError
from convert.cli import convert
from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
from dsv4_jax.tools import cli
from dsv4_jax.runtime.compile_cache import CompileCounter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dsv4_jax.ModelConfig.from_hf(TINY)
FAST = ["--dtype", "float32", "--compile-cache", "off"]  # in-process runs leave jax's cache setting alone


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A --dtype native conversion of an FP8/FP4 checkpoint (quantized leaves as .values/.scale)."""
    root = tmp_path_factory.mktemp("cli")
    write_hf_checkpoint(dsv4_jax.init_params(CFG, seed=3, std=0.1), CFG, str(root / "hf"), quantize=True)
    convert(str(root / "hf"), str(root / "native"), dtype="native")
    return root / "native"


@pytest.fixture()
def copy(native, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(native, out)
    return out


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---- item 3: a damaged converted directory is one line naming the array and the file ------------

def _chunk(d):
    return d / "params" / "embed" / "c" / "0" / "0"


DAMAGE = {
    "chunk_deleted": (lambda d: _chunk(d).unlink(),
                      r"array 'embed' is damaged: chunk file \S*params/embed/c/0/0 is missing; convert it again"),
    "chunk_truncated": (lambda d: _chunk(d).write_bytes(_chunk(d).read_bytes()[:100]),
                        r"array 'embed' is damaged: chunk file \S*params/embed/c/0/0 has 100 bytes, not \d+"),
    "values_deleted": (lambda d: shutil.rmtree(d / "params" / "layers.attn.wq_a.values"),
                       r"array 'layers.attn.wq_a.values' is missing \(\S*params/layers.attn.wq_a.values/zarr.json"),
    "zarr_json_corrupt": (lambda d: (d / "params" / "head" / "zarr.json").write_text("{"),
                          r"\S*params/head/zarr.json is damaged \(.*\): convert it again"),
    "metadata_deleted": (lambda d: (d / "params" / "_METADATA").unlink(),
                         r"\S*params/_METADATA is missing: \S*params is incomplete or damaged; convert it again"),
    "metadata_corrupt": (lambda d: (d / "params" / "_METADATA").write_text("{not json"),
                         r"\S*params/_METADATA is damaged \(.*\): convert it again"),
    "params_deleted": (lambda d: shutil.rmtree(d / "params"),
                       r"\S*params is missing: \S* is an incomplete dsv4-convert output; convert it again"),
    "old_format": (lambda d: [shutil.rmtree(d / "params"), (d / "params").mkdir(),
                              (d / "params" / "index.json").write_text('{"format": "dsv4_jax.zarr3/1", "leaves": {}}')],
                   r"written by an earlier dsv4-convert \(array store, format dsv4_jax.zarr3/1\), which this version "
                   r"does not read: convert it again"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_directory_load_error(copy, damage):
    breaker, message = DAMAGE[damage]
    breaker(copy)
    with pytest.raises(CheckpointError, match=message):
        dsv4_jax.load(copy)


_DAMAGED_CLI = """
import json, sys
from dsv4_jax.tools.cli import main
print(json.dumps([main(["--ckpt", d, "--ids", "1,2,3", "--max-new-tokens", "2", "--compile-cache", "off"])
                  for d in sys.argv[1:]]))
"""


def test_damaged_directory_cli(native, tmp_path):
    """Every damage above through dsv4-generate, in a fresh interpreter (noise at its exit
    counts): exit 1 and exactly one line each, naming the array / file; no traceback, no
    'Event loop is closed'."""
    dirs = []
    for name, (breaker, _) in DAMAGE.items():
        shutil.copytree(native, tmp_path / name)
        breaker(tmp_path / name)
        dirs.append(str(tmp_path / name))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _DAMAGED_CLI, *dirs], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == [1] * len(dirs)
    lines = stderr_lines(r.stderr)
    assert len(lines) == len(dirs), r.stderr
    for line, d, (_, message) in zip(lines, dirs, DAMAGE.values()):
        assert line.startswith("dsv4-generate: error: ") and d in line
        assert re.search(message, line), line


# ---- item 4: tokenizer and generation config ------------------------------------------------------

def _write_tokenizer(directory) -> None:
    """A word-level tokenizer over the model's vocabulary: 'w0' .. 'w95'."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(CFG.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))


def test_ids_ignore_a_missing_or_corrupt_tokenizer(copy, capsys):
    argv = ["--ckpt", str(copy), "--ids", "5,6,7", "--max-new-tokens", "3", "--no-eos", "--json", *FAST]
    rc, out, err = _run(argv, capsys)  # no tokenizer.json
    assert rc == 0 and err == ""
    ids = json.loads(out)["rows"][0]["ids"]
    assert len(ids) == 3 and json.loads(out)["rows"][0]["text"] is None
    (copy / "tokenizer.json").write_text("{ this is not a tokenizer")
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and json.loads(out)["rows"][0]["ids"] == ids
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "cannot be read" in err  # a note, not an error
    rc, out, err = _run(["--ckpt", str(copy), "--prompt", "w5 w6", *FAST], capsys)
    assert rc == 1 and out == ""
    assert err.startswith(f"dsv4-generate: error: {copy / 'tokenizer.json'}: cannot read the tokenizer (")
    assert len(err.splitlines()) == 1


def test_prompt_text_and_generation_config_eos(copy, capsys):
    """--prompt through tokenizer.json; without --eos the stop ids come from
    generation_config.json (a list: any of them stops), --eos overrides it."""
    _write_tokenizer(copy)
    base = ["--ckpt", str(copy), "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--json", *FAST]
    rc, out, _ = _run(base + ["--no-eos"], capsys)
    free = json.loads(out)["rows"][0]
    assert rc == 0 and free["prompt_ids"] == [5, 6, 7] and free["text"] == " ".join(f"w{i}" for i in free["ids"])
    stops = [free["ids"][2], (free["ids"][2] + 1) % CFG.vocab_size]
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    rc, out, _ = _run(base, capsys)
    got = json.loads(out)
    first = min(i for i, t in enumerate(free["ids"]) if t in stops)
    assert rc == 0 and got["eos_token_id"] == stops and got["rows"][0]["ids"] == free["ids"][: first + 1]
    rc, out, _ = _run(base + ["--eos", str(stops[1])], capsys)
    assert json.loads(out)["eos_token_id"] == stops[1]
    (copy / "generation_config.json").write_text("{broken")
    rc, out, err = _run(base, capsys)
    assert rc == 1 and "generation_config.json cannot be read" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1", "1;", "1;;2", "a,b"])
def test_ids_with_empty_or_bad_entries(native, capsys, ids):
    with CompileCounter() as c:
        rc, out, err = _run(["--ckpt", str(native), "--ids", ids, *FAST], capsys)
    assert rc == 1 and "--ids must be comma-separated integers" in err and c.programs == []


def test_parse_ids():
    assert cli._parse_ids("1,2,3") == [[1, 2, 3]]
    assert cli._parse_ids(" 1, 2 ;3") == [[1, 2], [3]]


# ---- item 2: the persistent compilation cache -----------------------------------------------------

def test_second_run_compiles_nothing(native, tmp_path):
    """Two dsv4-generate runs with the same request, each a fresh process. The first, without
    --compile-cache, fills the default directory ($XDG_CACHE_HOME/dsv4-jax/jax); the second,
    pointed at it by --compile-cache, loads every program and compiles none."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "dsv4_jax.tools.cli", "--ckpt", str(native), "--ids", "5,6,7;8,9", "--max-new-tokens",
            "4", "--json"]
    runs = []
    for extra in ([], ["--compile-cache", str(tmp_path / "xdg" / "dsv4-jax" / "jax")]):
        r = subprocess.run(argv + extra, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout))
    first, second = runs
    cache_dir = str(tmp_path / "xdg" / "dsv4-jax" / "jax")
    assert first["compile_cache"] == second["compile_cache"] == cache_dir
    assert first["compiled_programs"] > 0 and len(os.listdir(cache_dir)) > 0
    assert second["compiled_programs"] == 0
    assert second["programs_from_cache"] == first["compiled_programs"] + first["programs_from_cache"]
    assert second["rows"] == first["rows"]


def test_compile_cache_off_and_bad_dir(tmp_path, capsys):
    import jax

    from dsv4_jax.runtime import compile_cache

    before = jax.config.jax_compilation_cache_dir
    assert compile_cache.enable("off") is None and jax.config.jax_compilation_cache_dir == before
    (tmp_path / "file").write_text("")
    rc, _, err = _run(["--ckpt", str(tmp_path), "--ids", "1", "--compile-cache", str(tmp_path / "file" / "x")], capsys)
    assert rc == 1 and err.startswith(f"dsv4-generate: error: --compile-cache {tmp_path / 'file' / 'x'}: cannot create")
    assert jax.config.jax_compilation_cache_dir == before


# ---- item 8: the other CLIs reject bad input before the work ---------------------------------------

def test_bench_out_checked_first(tmp_path, monkeypatch, capsys):
    from dsv4_jax.tools import bench

    monkeypatch.setattr(bench, "run", lambda **kw: pytest.fail("the benchmark ran"))
    for out, msg in ((tmp_path / "missing" / "b.json", "does not exist"), (tmp_path, "is a directory")):
        assert bench.main(["--quick", "--skip-transformers", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"dsv4-bench: error: --out {out}: ") and msg in err
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("args, msg", [
    (["--prompt-len", "0"], "--prompt-len must be >= 1, got 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
    (["--prompts", "[]"], "prompts is empty"),
    (["--prompts", "[[]]"], "prompt is empty"),
    (["--prompts", "[[1, 2], [3, 96]]"], r"prompt\[1\]: token id 96 is outside the vocabulary \[0, 96\)"),
    (["--prompts", "[1, 2]"], "flat list of integers"),
    (["--prompts", "[[1, 2], [3]]"], r"prompts must have one length"),
])
def test_index_cache_report_rejects_before_compiling(native, tmp_path, capsys, args, msg):
    from dsv4_jax.tools.index_cache_report import main

    if args[0] == "--prompts":
        (tmp_path / "p.json").write_text(args[1])
        args = ["--prompts", str(tmp_path / "p.json")]
    with CompileCounter() as c:
        rc = main(["--ckpt", str(native), "--compile-cache", "off", *args])
    err = capsys.readouterr().err
    assert rc == 1 and re.search(msg, err) and c.programs == [], err
