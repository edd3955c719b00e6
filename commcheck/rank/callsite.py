"""The user's call site, as ``path:line func``, in names the user recognises.

The first frame outside torch and commcheck is where the collective was asked for. When
it lies in an installed package (a framework: Lightning, Accelerate, transformers) or
elsewhere outside the script's project, the first frame of the user's own code is kept
too: ``lightning/fabric/utilities/distributed.py:214 _sync_ddp ← train.py:57 step``.

Paths: installed files from their package root (the ``sys.path`` entry holding them), user
files relative to the script's project root (the directory of the main module), or
absolute; never climbing out with ``..``. With no project (the main module is itself
installed: pytest, a console script), every file not installed is the user's, absolute.

Compiled code: a frame of a module Inductor generated (``torch.compile``) stands for the
user's line the collective was traced from. Inductor keeps, per generated module, a map
from its lines to the FX node's source stack (``PyCodeCache.linemaps``, what it rewrites
tracebacks with); that stack, walked like the live one, names the site
(``train.py:36 forward``). A generated line the map says nothing of is a library frame.
A graph from Inductor's cache carries the stack of the compile that filled it: a line that
no longer holds the code it held then is looked for nearby (:func:`_current`).

Cost: a code object is classified once, a (code object, instruction offset) pair is
formatted once; a call is a frame walk with a dict look-up per frame. The dicts are keyed by
the code object's ``id`` (each classified code object is kept alive in ``_alive``, so an id
is not reused while it is a key): a code object's own hash is computed afresh on every call
from its constants and names (1 µs for a module-level script's code object, more for a long
training function), which a per-call key cannot afford.
"""

from __future__ import annotations

import bisect
import functools
import linecache
import os
import re
import sys
import sysconfig
from collections.abc import Callable
from types import ModuleType

import torch

from ..wire import SITE_SEP

_SKIP = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
_SKIPPED, _LIBRARY, _USER, _COMPILED = 0, 1, 2, 3
# Dynamo names the code after a graph break after the function it resumes
_RESUMED = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")
# one frame of an FX node's stack trace, with its line of code
_FRAME = re.compile(r'File "(.+)", line (\d+), in (.+)\n(?: {4}(.*)\n)?')
_MAX = 65536

_kind: dict[int, int] = {}  # id(code) -> _SKIPPED, _LIBRARY or _USER
_alive: list[object] = []  # the code objects _kind and _cache name by id
_cache: dict[tuple, str] = {}  # (id(code), offset[, id(user code), offset]) -> text
_root: list[str | None] = []  # [project root or None], resolved on first use


def _installed(path: str) -> bool:
    parts = path.split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts or path.startswith(_STDLIB)


def _stdlib() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(os.path.realpath(paths[k]), "")
                  for k in ("stdlib", "platstdlib") if k in paths})


_STDLIB = _stdlib()


def project_root() -> str | None:
    """The directory of the main module (``-m pkg.mod``: the directory holding ``pkg``);
    None where the main module is installed, or there is none (an interactive session)."""
    if _root:
        return _root[0]
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0]
                                               not in ("", "-c", "-m") else None)
    root = None
    if path:
        path = os.path.realpath(os.path.abspath(path))
        root = os.path.dirname(path)
        spec = getattr(main, "__spec__", None)
        name = getattr(spec, "name", "") or ""
        for _ in range(name.count(".")):
            root = os.path.dirname(root)
        if _installed(path) or not path.endswith(".py"):
            root = None  # pytest, a console script: no project of the user's
    _root.append(root)
    return root


def _linemaps() -> dict | None:
    """Inductor's line maps of the modules it generated, where Inductor was ever loaded."""
    codecache = sys.modules.get("torch._inductor.codecache")
    return getattr(getattr(codecache, "PyCodeCache", None), "linemaps", None)


def _classify(filename: str) -> int:
    maps = _linemaps()
    if maps and maps.get(filename):
        return _COMPILED
    if filename.startswith(_SKIP) or filename.startswith("<frozen"):
        return _SKIPPED
    if filename.startswith("<"):  # <stdin>, <string>: the user's, typed or exec'd
        return _USER
    path = os.path.realpath(os.path.abspath(filename))
    if _installed(path):
        return _LIBRARY
    root = project_root()
    if root is None or path.startswith(os.path.join(root, "")):
        return _USER
    return _LIBRARY


def shown(filename: str) -> str:
    """``filename`` as the report shows it (see the module's docstring)."""
    if filename.startswith("<"):
        return filename
    path = os.path.realpath(os.path.abspath(filename))
    root = project_root()
    if root is not None and path.startswith(os.path.join(root, "")):
        return os.path.relpath(path, root)
    if root is None and not _installed(path):
        return path
    best = ""
    for entry in sys.path:
        if not entry or not isinstance(entry, str):
            continue
        entry = os.path.join(os.path.realpath(os.path.abspath(entry)), "")
        if path.startswith(entry) and len(entry) > len(best):
            best = entry
    return path[len(best):] if best else path


def _frame_text(f) -> str:
    return f"{shown(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"


def _learn(code) -> int:
    if len(_kind) > _MAX:
        _kind.clear()
        _cache.clear()
        _alive.clear()
    _alive.append(code)
    k = _kind[id(code)] = _classify(code.co_filename)
    return k


def _stack(filename: str, line: int) -> list[tuple[str, int, str]]:
    """(file, line, function) of the source stack Inductor's line map holds for ``line`` of
    its generated ``filename``, innermost first."""
    entry = (_linemaps() or {}).get(filename)
    if not entry:
        return []
    lines, traces = entry
    p = bisect.bisect_right(lines, line)
    trace = traces[p - 1] if p else None
    if not trace:
        return []
    return [(f, _current(f, int(n), code), name)
            for f, n, name, code in reversed(_FRAME.findall(trace))]


def _current(path: str, line: int, code: str) -> int:
    """``line`` of ``path`` as the file is now. A graph from Inductor's cache carries the
    stack of the compile that filled the cache: where lines moved since, the nearest line
    holding the same code is the one."""
    code = code.strip()
    if not code or linecache.getline(path, line).strip() == code:
        return line
    hits = [i for i, text in enumerate(linecache.getlines(path), 1) if text.strip() == code]
    return min(hits, key=lambda i: abs(i - line)) if hits else line


def traced(filename: str, line: int) -> str | None:
    """The site a line of Inductor's generated ``filename`` was traced from; None where its
    line map holds no frame outside torch and commcheck."""
    try:
        frames = _stack(filename, line)
    except Exception:
        return None
    site = None
    for path, n, func in frames:
        k = _classify(path)
        if k in (_SKIPPED, _COMPILED):
            continue
        name = _RESUMED.sub(r"\1", func)
        text = f"{shown(path)}:{n} {name}"
        if k == _USER:
            return text if site is None else site + SITE_SEP + text
        if site is None:
            site = text
    return site


def _compiled(f) -> str | None:
    """:func:`traced` for a generated frame, once per instruction ("": nothing traced)."""
    key = (id(f.f_code), f.f_lasti, _COMPILED)
    s = _cache.get(key)
    if s is None:
        if len(_cache) > _MAX:
            _cache.clear()
        s = _cache[key] = traced(f.f_code.co_filename, f.f_lineno) or ""
    return s or None


def callsite(depth: int = 2) -> str:
    """Walk up from the caller's caller (``depth`` frames up) to the call site.

    A hook called from C++ on a thread without Python callers may have fewer frames: "?".
    """
    try:
        f = sys._getframe(depth)
    except ValueError:
        return "?"
    kinds = _kind
    while f is not None:
        code = f.f_code
        k = kinds.get(id(code))
        if k is None:
            k = _learn(code)
        if k:
            break
        f = f.f_back
    else:
        return "?"
    if k == _COMPILED:
        s = _compiled(f)
        if s is not None:
            return s
    if k == _USER:
        key: tuple = (id(code), f.f_lasti)
        user = None
    else:
        user = f.f_back
        while user is not None:
            ucode = user.f_code
            u = kinds.get(id(ucode))
            if u is None:
                u = _learn(ucode)
            if u == _USER:
                break
            user = user.f_back
        key = (id(code), f.f_lasti) if user is None else \
            (id(code), f.f_lasti, id(ucode), user.f_lasti)
    s = _cache.get(key)
    if s is None:
        if len(_cache) > _MAX:
            _cache.clear()
        s = _frame_text(f)
        if user is not None:
            s += SITE_SEP + _frame_text(user)
        _cache[key] = s
    return s


def tables() -> tuple[dict, dict, Callable[[int], str]]:
    """What the native walk reads and learns through (``hot.callsite``'s last three
    arguments): this module's kinds and sites, and :func:`callsite` for what they lack."""
    return _kind, _cache, callsite


def site_at(depth: int, hot: ModuleType | None) -> Callable[[], str]:
    """``callsite(depth)`` as a function of no arguments for a caller that always asks from
    the same depth (the hot path's ``prepare``): the native walk of ``hot``
    (:mod:`commcheck.native.hot`, on Python ≥ 3.11) over this module's dicts where there is
    one, which calls back into :func:`callsite` for what it has not learned yet."""
    fast = getattr(hot, "callsite", None)
    if fast is None:
        return functools.partial(callsite, depth)
    return functools.partial(fast, depth, *tables())
