"""The package layout's dependency rule (docs/design.md §1), read from the imports themselves.

Sides and what each may import (besides itself, the standard library and third parties):

    wire       nothing of commcheck (but the leaf ``_owner``)
    engine     wire
    rank       wire, native
    collector  wire, engine, and the package root (for ``__version__``)
    native     nothing (but the leaf ``_owner``)
    gradprobe  wire, native, rank
    relay      wire
    cli        anything (it mounts every side's commands)
    __main__   cli (``python -m commcheck``)
    run        native (``commcheck run`` starts processes, imports no side; it only builds
               the DDP hook before torchrun)
    _owner     nothing: the one directory-ownership rule that ``wire`` (data files) and
               ``native`` (libraries) share, a leaf so neither depends on the other

Every import counts, also one inside a function: a lazy import hides a cycle, it does not
remove it. Only ``if TYPE_CHECKING:`` imports are left out (they never run).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "commcheck"

ALLOWED = {
    "wire": {"wire", "_owner"},
    "engine": {"engine", "wire"},
    "rank": {"rank", "wire", "native"},
    "collector": {"collector", "wire", "engine", ""},
    "native": {"native", "_owner"},
    "gradprobe": {"gradprobe", "wire", "native", "rank"},
    "relay": {"relay", "wire"},
    "cli": None,
    "__main__": {"cli"},
    "run": {"run", "native"},
    "_owner": set(),
    "": set(),  # the package root resolves its names lazily, by string
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def side(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The commcheck modules ``path`` imports (a package's ``from P import m`` counts ``P.m``
    when ``m`` is a module)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "commcheck")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "commcheck":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    found.discard(me)
    return found


def graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        allowed = ALLOWED.get(side(mod), set())
        if allowed is None:
            continue
        for dep in sorted(deps):
            if side(dep) not in allowed and side(dep) != side(mod):
                bad.append(f"{mod} imports {dep}")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_side_imports_only_what_the_rule_allows():
    g = graph()
    assert {side(m) for m in g} <= set(ALLOWED), "a new side needs its line in ALLOWED"
    assert violations(g) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_rule_catches_a_rank_module_importing_the_collector(tmp_path):
    g = graph()
    g["commcheck.rank.session"] = g["commcheck.rank.session"] | {"commcheck.collector.store"}
    assert violations(g) == ["commcheck.rank.session imports commcheck.collector.store"]
    g["commcheck.collector.store"] = g["commcheck.collector.store"] | {"commcheck.rank.session"}
    assert ["commcheck.collector.store", "commcheck.rank.session"] in cycles(g)


def test_imports_are_read_from_relative_lazy_and_package_forms(tmp_path, monkeypatch):
    pkg = tmp_path / "commcheck"
    (pkg / "rank").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rank" / "__init__.py").write_text("")
    (pkg / "rank" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from ..collector import c\n"
        "def f():\n    from ..engine.d import x\n")
    (pkg / "rank" / "b.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    modules = {"commcheck.rank.a", "commcheck.rank.b"}
    assert imports_of(pkg / "rank" / "a.py", modules) == {"commcheck.rank.b", "commcheck.engine.d"}
