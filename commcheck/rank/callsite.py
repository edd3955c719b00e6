"""The user's call site: the first frame outside torch and commcheck, as ``path:line func``."""

from __future__ import annotations

import os
import sys

import torch

_SKIP = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
_cache: dict[tuple[object, int], str] = {}


def callsite(depth: int = 2) -> str:
    """Walk up from the caller's caller; cached per (code object, line).

    A hook called from C++ on a thread without Python callers may have fewer frames.
    """
    try:
        f = sys._getframe(depth)
    except ValueError:
        return "?"
    while f is not None:
        code = f.f_code
        if not code.co_filename.startswith(_SKIP) and not code.co_filename.startswith("<frozen"):
            key = (code, f.f_lineno)
            s = _cache.get(key)
            if s is None:
                if len(_cache) > 65536:
                    _cache.clear()
                s = _cache[key] = f"{code.co_filename}:{f.f_lineno} {code.co_name}"
            return s
        f = f.f_back
    return "?"
