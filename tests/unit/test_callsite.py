"""Call sites in names the user recognises: installed code from its package root, the
user's own frame kept beside a framework's, never a path climbing out with ``..``."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import pytest

from commcheck.native import hot
from commcheck.rank import callsite as cs

LIB = """\
from commcheck.rank.callsite import callsite


def sync(fn=None):
    if fn is not None:
        return fn()
    return callsite(1)


def sync_with(site):
    return site()
"""
USER = """\
import fakelib.dist


def main():
    return fakelib.dist.sync()


def direct():
    from commcheck.rank.callsite import callsite
    return callsite(1)


def twice():
    out = []
    for _ in range(2):
        out.append(fakelib.dist.sync())
    return out


def twice_with(site):
    out = []
    for _ in range(2):
        out.append(fakelib.dist.sync_with(site))
    return out


def direct_with(site):
    return site()
"""


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """An installed package (``site-packages/fakelib``), a project (``proj/train.py``,
    ``proj/sub/helper.py``) and a sibling library outside it (``other/extlib.py``)."""
    site = tmp_path / "venv" / "lib" / "site-packages"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text("")
    (site / "fakelib" / "dist.py").write_text(LIB)
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "train.py").write_text(USER)
    (proj / "sub" / "__init__.py").write_text("")
    (proj / "sub" / "helper.py").write_text(
        "import train\n\n\ndef go():\n    return train.main()\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "extlib.py").write_text("import train\n\n\ndef go():\n    return train.direct()\n")
    for p in (site, proj, other):
        monkeypatch.syspath_prepend(str(p))
    monkeypatch.setattr(cs, "_root", [os.path.realpath(proj)])
    monkeypatch.setattr(cs, "_kind", {})
    monkeypatch.setattr(cs, "_cache", {})
    monkeypatch.chdir(tmp_path / "venv")  # a cwd far from both: nothing is relative to it
    yield tmp_path
    for name in ("fakelib", "fakelib.dist", "train", "sub", "sub.helper", "extlib"):
        sys.modules.pop(name, None)


def test_framework_frame_and_user_frame_both_shown(tree):
    train = importlib.import_module("train")
    assert train.main() == "fakelib/dist.py:7 sync ← train.py:5 main"


def test_user_code_alone_relative_to_the_project(tree):
    train = importlib.import_module("train")
    assert train.direct() == "train.py:10 direct"
    helper = importlib.import_module("sub.helper")
    assert helper.go() == "fakelib/dist.py:7 sync ← train.py:5 main"


def test_code_outside_the_project_is_not_climbed_to(tree):
    extlib = importlib.import_module("extlib")
    site = extlib.go()
    assert site == "train.py:10 direct"
    assert ".." not in site


def test_a_library_frame_with_no_user_frame_above_is_shown_alone(tree):
    lib = importlib.import_module("fakelib.dist")
    # the caller (this test file) lies outside the project: a library frame too
    site = lib.sync()
    assert site.startswith("fakelib/dist.py:7 sync")
    assert ".." not in site and not site.startswith("/")


def test_without_a_project_user_files_are_absolute(tree, monkeypatch):
    monkeypatch.setattr(cs, "_root", [None])
    train = importlib.import_module("train")
    assert train.direct() == f"{os.path.realpath(tree / 'proj' / 'train.py')}:10 direct"
    assert train.main() == "fakelib/dist.py:7 sync ← " \
        f"{os.path.realpath(tree / 'proj' / 'train.py')}:5 main"


def test_resolved_once_per_code_location(tree):
    train = importlib.import_module("train")
    a, b = train.twice()
    assert a == b == "fakelib/dist.py:7 sync ← train.py:16 twice"
    assert a is b  # the second call is a cache hit
    assert len(cs._cache) == 1


def test_project_root_of_a_script_and_of_an_installed_main(tmp_path, monkeypatch):
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text("")
    main = type(sys)("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(cs, "_root", [])
    assert cs.project_root() == os.path.realpath(script.parent)
    main.__file__ = str(tmp_path / "venv" / "lib" / "site-packages" / "pytest" / "__main__.py")
    monkeypatch.setattr(cs, "_root", [])
    assert cs.project_root() is None


def test_code_typed_or_execd_is_the_users_and_kept_as_named(tree):
    code = compile("from commcheck.rank.callsite import callsite\nsite = callsite(1)\n",
                   "<stdin>", "exec")
    ns: dict = {}
    exec(code, ns)
    assert ns["site"] == "<stdin>:2 <module>"


@pytest.mark.skipif(getattr(hot.module(), "callsite", None) is None,
                    reason="no native extension, or Python < 3.11")
def test_the_native_walk_finds_what_the_python_one_learned(tree):
    """The hot path's call site (hot.c's walk over this module's dicts): the same text as
    :func:`callsite`, the Python walk asked only for what it has not seen yet."""
    train = importlib.import_module("train")
    slow: list[int] = []

    def learn(depth: int) -> str:
        slow.append(depth)
        return cs.callsite(depth + 1)  # one frame more: this one

    site = functools.partial(hot.module().callsite, 1, cs._kind, cs._cache, learn)
    a, b = train.twice_with(site)
    assert a == b == "fakelib/dist.py:11 sync_with ← train.py:23 twice_with"
    assert slow == [1]  # the second call was found in C
    assert train.direct_with(site) == "train.py:28 direct_with"
    assert train.direct_with(site) == "train.py:28 direct_with"
    assert slow == [1, 1]
    assert cs.site_at(1, hot.module()).args[1:] == (cs._kind, cs._cache, cs.callsite)
    assert cs.site_at(1, None).func is cs.callsite


GENERATED = """\
from commcheck.rank.callsite import callsite


def call():
    # Topologically Sorted Source Nodes: [outputs_1], Original ATen: [all_reduce]
    return callsite(1)
"""


def _generated(tree, name: str, stack: str | None):
    """A module as Inductor writes one, its line map saying ``stack`` for line 5 on."""
    from torch._inductor.codecache import PyCodeCache

    path = tree / "inductor" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(GENERATED)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    PyCodeCache.linemaps[str(path)] = [(5,), (stack,)] if stack else []
    return mod


def _trace(*frames: tuple[str, int, str]) -> str:
    """An FX node's ``stack_trace``: outermost frame first."""
    return "".join(f'  File "{f}", line {n}, in {fn}\n    code\n' for f, n, fn in frames)


def test_generated_code_is_sited_at_the_line_it_was_traced_from(tree):
    import torch

    proj = tree / "proj"
    torch_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor",
                              "_api.py")
    mod = _generated(tree, "cgen1", _trace((str(proj / "train.py"), 36, "forward"),
                                           (torch_file, 1210, "<lambda>")))
    assert mod.call() == "train.py:36 forward"
    resumed = _generated(tree, "cgen2", _trace(
        (str(proj / "train.py"), 43, "torch_dynamo_resume_in_forward_at_42")))
    assert resumed.call() == "train.py:43 forward"
    site = tree / "venv" / "lib" / "site-packages" / "fakelib" / "dist.py"
    lib = _generated(tree, "cgen3", _trace((str(proj / "train.py"), 5, "main"),
                                           (str(site), 7, "sync")))
    assert lib.call() == "fakelib/dist.py:7 sync ← train.py:5 main"


def test_generated_code_its_line_map_says_nothing_of_is_a_library_frame(tree):
    mod = _generated(tree, "cgen4", None)
    site = mod.call()
    assert site.startswith(f"{tree / 'inductor' / 'cgen4.py'}:6 call")
    assert "train.py" not in site


def test_a_cached_graphs_stale_line_is_found_where_its_code_moved(tree):
    """Inductor's cache gives back the stack of the compile that filled it: the file has
    gained lines since; the code it names is looked for, nearest first."""
    proj = tree / "proj"
    stale = '  File "{}", line 2, in main\n    return fakelib.dist.sync()\n'.format(
        proj / "train.py")
    assert _generated(tree, "cgen5", stale).call() == "train.py:5 main"
    gone = '  File "{}", line 2, in main\n    no_such_code()\n'.format(proj / "train.py")
    assert _generated(tree, "cgen6", gone).call() == "train.py:2 main"
