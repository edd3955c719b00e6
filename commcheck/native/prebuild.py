"""Native code made ready before training: what ``commcheck build`` and ``commcheck run`` do.

The C kernel and the per-call path come built with the package (setup.py); the C++ DDP hook
needs torch's C++ ABI, so it is built on the node, here, before any rank starts
(docs/native.md, "No build inside training").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from . import ddphook

Say = Callable[[str], None]


def ddp_hook(say: Say) -> Path | None:
    """The DDP hook's library, built now unless it already is (then nothing is said); None,
    said in one line, where it cannot be (the ranks then use the Python hook)."""
    if not ddphook.enabled():
        return None
    try:
        found = ddphook.built()
        if found is not None:
            return found
        say("building the native DDP hook (once per node and torch version; about a minute)")
        t0 = time.monotonic()
        path = ddphook.build()
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        say(f"the native DDP hook cannot be built ({text[:300]}); DDP buckets are checked "
            f"by the Python hook (slower)")
        return None
    say(f"built the native DDP hook in {time.monotonic() - t0:.0f} s ({path})")
    return path


def _origin(name: str, loaded_from: str | None) -> str:
    from . import loader

    if loaded_from is None:
        return "unavailable (the Python path is used)"
    where = loader.installed_origin(name)
    return f"built with the package ({where})" if str(where) == loaded_from else \
        "built on first use into the private cache"


def main(say: Say) -> int:
    """Every native part ready or said unavailable; 1 where the DDP hook cannot be built."""
    from . import hot, loader  # torch and numpy: not for ddp_hook, which commcheck run calls

    kernel, per_call = loader.kernel(), hot.module()
    say(f"C kernel: {_origin('_kernel', kernel and kernel._lib._name)}")
    say(f"per-call path: {_origin('_hot', per_call and per_call.__file__)}")
    if not ddphook.enabled():
        say(f"DDP hook: off ({ddphook.ENV}=0)")
        return 0
    path = ddp_hook(say)
    if path is not None:
        say(f"DDP hook: {path}")
    return 0 if path is not None else 1
