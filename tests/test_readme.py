"""The README and the documents under docs/ against the package: their Python code runs, every
API they name exists under that name (and takes the arguments shown), every repository path they
name exists, and every command-line flag they show is one the command accepts."""

import ast
import importlib
import inspect
import os
import re
import runpy
import shlex
import sys
import tomllib

import numpy as np
import pytest

import dsv4_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))
README = "\n".join(open(os.path.join(ROOT, f)).read() for f in DOCS)  # (each file ends in a newline)
PACKAGES = ("dsv4_jax", "pallas_kernels", "convert")


def _blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)


def _spans() -> list[str]:
    """Inline code spans of the prose (fenced blocks removed; a span may wrap a line)."""
    prose = re.sub(r"^```.*?^```", "", README, flags=re.S | re.M)
    return [" ".join(m.split()) for m in re.findall(r"`([^`]+)`", prose)]


def _resolve(dotted: str):
    """The module or attribute `a.b.c` names: the longest importable module prefix, then
    attributes."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for p in parts[n:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(dotted)


def _is_file_name(name: str) -> bool:  # `convert.py`, `config.json`: files, not APIs
    return re.search(r"\.(py|json|md|txt|safetensors)$", name) is not None


def _placeholders(call: ast.Call):
    return [None] * len(call.args), {k.arg: None for k in call.keywords if k.arg}


def _dsv4_calls(tree) -> list[tuple[str, ast.Call]]:
    return [(n.func.attr, n) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == "dsv4_jax"]


def test_python_blocks_call_the_package_as_shown():
    blocks = [code for lang, code in _blocks() if lang == "python"]
    assert blocks
    for code in blocks:
        calls = _dsv4_calls(ast.parse(code))
        assert calls
        for name, call in calls:
            args, kwargs = _placeholders(call)
            inspect.signature(getattr(dsv4_jax, name)).bind(*args, **kwargs)


def test_python_blocks_run(tmp_path):
    """The Use block, run as written on a tiny checkpoint (its path and `input_ids` filled in)."""
    from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
    from hf_oracle import TINY

    cfg = dsv4_jax.ModelConfig.from_hf(TINY)
    write_hf_checkpoint(dsv4_jax.init_params(cfg, seed=0, std=0.1), cfg, str(tmp_path))
    for lang, code in _blocks():
        if lang != "python":
            continue
        code = code.replace('"path/to/checkpoint"', repr(str(tmp_path)))
        scope = {"input_ids": np.array([[1, 2, 3, 4]], np.int32)}
        exec(compile(code, "README.md", "exec"), scope)
        if "out" in scope:
            assert scope["out"].rows() and len(scope["out"].rows()) == 2


def test_named_apis_exist():
    """`dsv4_jax.x.y` (and `pallas_kernels.` / `convert.`) anywhere in the README; `mod.name` spans
    whose first part is a dsv4_jax module or export; `name(args)` spans naming a dsv4_jax export,
    bound to its signature unless written `name(...)`."""
    names = {n for n in re.findall(r"\b((?:%s)(?:\.\w+)+)(?![\w/])" % "|".join(PACKAGES), README)
             if not _is_file_name(n)}
    assert {"dsv4_jax.index_cache_schedule", "dsv4_jax.checkpoint.loading.load_mtp_params"} <= names
    for dotted in sorted(names):
        _resolve(dotted)  # raises if missing
    checked_calls = set()
    for span in _spans():
        m = re.fullmatch(r"(\w+)\.(\w+)(?:\(.*\))?", span)
        if m and not _is_file_name(span):
            first, attr = m.groups()
            if hasattr(dsv4_jax, first):
                assert hasattr(getattr(dsv4_jax, first), attr), span
            elif importlib.util.find_spec(f"dsv4_jax.{first}") is not None:
                assert hasattr(importlib.import_module(f"dsv4_jax.{first}"), attr), span
        m = re.fullmatch(r"(\w+)\(([^()]*)\)", span)
        if m:
            name, args = m.groups()
            assert hasattr(dsv4_jax, name), f"README names {span!r}, dsv4_jax has no {name!r}"
            if args != "...":
                call = ast.parse(span, mode="eval").body
                inspect.signature(getattr(dsv4_jax, name)).bind(*_placeholders(call)[0], **_placeholders(call)[1])
            checked_calls.add(name)
    assert {"step", "cache_bytes"} <= checked_calls


def test_named_paths_exist():
    paths = {s for s in _spans() if re.fullmatch(r"(dsv4_jax|convert|pallas_kernels|tests|examples|docs)/[\w./-]*", s)}
    assert "dsv4_jax/model/layer_weights.py" in paths
    for p in sorted(paths):
        assert os.path.exists(os.path.join(ROOT, p.split("::")[0])), p
    for s in _spans():
        m = re.fullmatch(r"(tests/\w+\.py)::(\w+)", s)
        if m:
            assert f"def {m.group(2)}(" in open(os.path.join(ROOT, m.group(1))).read(), s


# ---- command-line flags ---------------------------------------------------------------------------

SCRIPTS = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]
FLAG = r"--[a-z][a-z0-9-]*"


def _program(command: str) -> tuple[str, str] | None:
    """How to run the command a README line starts: ("script", an entry point pyproject
    installs), ("module", `python -m` its module) or ("path", `python` its file); None for
    anything else (pip, pytest's own flags are not ours to check)."""
    words = command.split()
    if not words:
        return None
    if m := re.fullmatch(r"(?:\.venv/bin/)?(dsv4-[a-z-]+)", words[0]):  # (`dsv4-convert: wrote ...` is a message)
        assert m.group(1) in SCRIPTS, f"README runs {m.group(1)}, which pyproject.toml does not install"
        return "script", m.group(1)
    if re.fullmatch(r"(\S*/)?python3?", words[0]) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and words[2].split(".")[0] in PACKAGES:
            return "module", words[2]
        if words[1].endswith(".py"):
            return "path", words[1]
    return None


def _help(kind: str, target: str, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [target, "--help"])
    with pytest.raises(SystemExit) as e:
        if kind == "script":
            module, fn = SCRIPTS[target].split(":")
            getattr(importlib.import_module(module), fn)(["--help"])
        elif kind == "module" and hasattr(importlib.import_module(target), "main"):
            importlib.import_module(target).main(["--help"])
        elif kind == "module":  # a package's __main__
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.join(ROOT, target), run_name="__main__")
    assert e.value.code == 0
    return capsys.readouterr().out


def _commands() -> list[str]:
    """Commands in fenced blocks (a line starting with blanks continues the one before; `&&`
    separates commands; leading environment assignments, `XLA_FLAGS=... cmd`, dropped) and in
    code spans."""
    out = []
    for lang, code in _blocks():
        if lang in ("bash", ""):
            lines = []
            for line in code.splitlines():
                if line[:1].isspace() and lines:
                    lines[-1] += " " + line.strip()
                else:
                    lines.append(line.strip())
            out += [re.sub(r"^([A-Z_]+=\S+\s+)+", "", c.strip()) for line in lines for c in line.split("&&")]
    return out + _spans()


def _parts(command: str) -> list[tuple]:
    """(program, text) pairs whose flags belong to that program. serve_compare passes flags on:
    its --server values and --serve-flags to dsv4-serve, everything after `--` to dsv4-bench-serve."""
    prog = _program(command)
    if prog != ("module", "dsv4_jax.tools.serve_compare"):
        return [(prog, command)]
    own, _, bench = command.replace("\\ ", " ").partition(" -- ")
    words = shlex.split(own)
    passed = [w.partition("=")[2] if w.partition("=")[1] else w
              for i, w in enumerate(words) if i and words[i - 1] in ("--server", "--serve-flags")]
    mine = [w for i, w in enumerate(words) if not (i and words[i - 1] in ("--server", "--serve-flags"))]
    return [(prog, " ".join(mine)), (("script", "dsv4-serve"), " ".join(passed)),
            (("script", "dsv4-bench-serve"), bench)]


def test_flags_exist(monkeypatch, capsys):
    """A flag in a command is one its program accepts (from its --help); a flag in a code span
    with no program (`--dtype native`) is one some CLI accepts (an installed one, or one the
    README runs)."""
    helps = {}

    def flags(prog):
        if prog not in helps:
            helps[prog] = set(re.findall(FLAG, _help(*prog, monkeypatch, capsys)))
        return helps[prog]

    programs = {("script", name) for name in SCRIPTS} | {p for p in map(_program, _commands()) if p}
    every = set().union(*map(flags, programs))
    assert "--compile-cache" in flags(("script", "dsv4-generate")) and "--out" in flags(("script", "dsv4-bench"))
    seen = set()
    for command in _commands():
        for prog, part in _parts(command):
            shown = re.findall(FLAG, part)
            have = flags(prog) if prog else every
            for flag in shown:
                ok = any(h.startswith(flag) for h in have) if command.endswith(flag + "*") else flag in have
                assert ok, f"README: {command!r} shows {flag}, not a flag of {prog[1] if prog else 'any CLI'}"
                seen.add(flag)
    assert {"--compile-cache", "--ids", "--eos", "--no-eos", "--pattern", "--prompt-len"} <= seen


def test_commands_run_as_printed_after_the_setup():
    """Every command the README shows (a program with arguments: ours, or python) runs as printed
    after the two set-up commands: from the virtual environment they make, `.venv/bin/...`."""
    bare = []
    for command in _commands():
        words = command.split()
        if len(words) < 2 or words[0].endswith(":") or words[:3] == ["python3", "-m", "venv"]:
            continue
        if re.fullmatch(r"(\S*/)?(dsv4-[a-z-]+|python3?)", words[0]) and not words[0].startswith(".venv/bin/"):
            bare.append(command)
    assert not bare, bare
    assert any(c.startswith(".venv/bin/dsv4-serve ") for c in _commands())


def test_readme_is_a_landing_page():
    """The README stays short (the rest lives in docs/), starts with the two set-up commands
    exactly as CI runs the second, and links every document under docs/."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) <= 200
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, flags=re.S | re.M)
    assert blocks[0].strip().endswith(".venv/bin/python examples/demo.py")
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert blocks[1].strip() in ci
    assert {f"`{f}`" for f in DOCS[1:]} <= set(re.findall(r"`docs/[\w.-]+\.md`", readme))
