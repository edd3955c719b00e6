"""Two rules of the code's shape, read from the source: no two modules of ``commcheck``
import each other, however indirectly (``TYPE_CHECKING`` imports included: a circle of
knowledge is one even when it costs nothing at run time), and no function is longer than
80 lines (a longer one is split where its parts can be named)."""

from __future__ import annotations

import ast
from pathlib import Path

from .test_layout import cycles

PKG = Path(__file__).resolve().parents[2] / "commcheck"
MAX_LINES = 80


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The commcheck modules ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in mods else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in mods and m != name}


def test_no_module_imports_itself_through_others():
    mods = _modules()
    edges = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert cycles(edges) == []


def test_the_circle_check_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} "
                                f"({lines} lines)")
    assert long == []
