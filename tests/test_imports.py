"""The packages' floors: every import (at module level or inside a function) of dsv4_jax, convert
and pallas_kernels, read from the source, goes down or across a floor, never up, and no modules
import each other in a circle."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "dsv4_jax", "convert")
# Lowest first. A module may import its own floor and those below. `dsv4_jax` alone is the public
# API (dsv4_jax/__init__.py: load, generate, Engine, ...), over the runtime and under the server.
FLOORS = ("pallas_kernels", "dsv4_jax.model", "dsv4_jax.checkpoint", "dsv4_jax.runtime", "dsv4_jax.training", "dsv4_jax",
          "dsv4_jax.serving", "dsv4_jax.tools", "convert")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports (a name imported from a package
    counts as its submodule when there is one; else as the package)."""
    edges = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != name:
                    found.add(t)
        edges[name] = found
    return edges


def _floor(module: str) -> int:
    return max((i for i, f in enumerate(FLOORS) if module == f or module.startswith(f + ".")),
               key=lambda i: len(FLOORS[i]))


def test_every_module_is_on_a_floor():
    mods = _modules()
    assert len(mods) > 60, sorted(mods)  # the walk found the packages
    loose = [m for m in mods if m.count(".") == 1 and m.startswith("dsv4_jax.")
             and not (ROOT / m.replace(".", "/") / "__init__.py").exists()]
    assert loose == [], f"modules directly in dsv4_jax/, on no floor: {loose}"


def test_imports_never_go_up_a_floor():
    edges = _imports(_modules())
    up = sorted(f"{a} ({FLOORS[_floor(a)]}) imports {b} ({FLOORS[_floor(b)]})"
                for a, bs in edges.items() for b in bs if _floor(b) > _floor(a))
    assert up == [], "\n".join(up)


def test_no_import_cycles():
    edges = _imports(_modules())
    state, stack, cycles = {}, [], []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == "open":
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert cycles == [], "\n".join(cycles)


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The reading above catches what it is for: a pair of modules importing each other, and a
    kernel importing the model, in a copy of the layout."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "dsv4_jax" / "model").mkdir()
    (tmp_path / "dsv4_jax" / "model" / "__init__.py").write_text("")
    (tmp_path / "dsv4_jax" / "model" / "a.py").write_text("from . import b\n")
    (tmp_path / "dsv4_jax" / "model" / "b.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "pallas_kernels" / "k.py").write_text("from dsv4_jax.model.a import y\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="dsv4_jax.model.a -> dsv4_jax.model.b -> dsv4_jax.model.a"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match=r"pallas_kernels.k \(pallas_kernels\) imports dsv4_jax.model.a"):
        test_imports_never_go_up_a_floor()
