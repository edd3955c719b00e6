"""The per-call C path (``hot.c``): ring writes and small-tensor fingerprints without ctypes.

A CPython extension built with the package (``setup.py``: ``commcheck.native._hot``) and
imported from there; a source tree without it (or with a stale one) builds it like the kernel
(:mod:`.loader`: system compiler, private per-user cache keyed by the sources, the compiler
and the Python build), which also needs Python's headers. Where it can be neither imported nor
built and loaded, :func:`module` is None (one log line) and the Python path does the same
work, slower. ``COMMCHECK_NATIVE_HOT=0`` forces the Python path.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from . import loader, private

log = logging.getLogger("commcheck")

SOURCE = Path(__file__).with_name("hot.c")
NAME = "commcheck.native._hot"
SOURCES = (SOURCE, loader.SOURCE, SOURCE.with_name("ccapi.h"),
           SOURCE.with_name("express.c"), SOURCE.with_name("gate.c"))  # setup.py's order


def _flags() -> tuple[str, ...]:
    include = sysconfig.get_paths()["include"]
    return (*loader.FLAGS, f"-I{include}", f"-I{SOURCE.parent}")


@functools.cache
def module() -> ModuleType | None:
    """The loaded extension with the XXH3 functions handed over; None where unavailable."""
    if os.environ.get("COMMCHECK_NATIVE_HOT", "1") == "0":
        return None
    try:
        mod = _installed()
        if mod is None:
            mod = _built()
        xxh3 = loader._load_xxh3()
        if xxh3 is None:
            raise OSError("the xxhash package exports no XXH3 functions")
        mod.set_xxh3(ctypes.cast(xxh3._reset[128], ctypes.c_void_p).value,
                     xxh3._update[128],
                     ctypes.cast(xxh3._digest[128], ctypes.c_void_p).value,
                     ctypes.cast(xxh3._create, ctypes.c_void_p).value)
        sys.modules[NAME] = mod  # PyCapsule_Import finds the C API under this name
        return mod
    except (OSError, ImportError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("commcheck: the native per-call path is unavailable (%s); the Python "
                    "path is used (slower)", exc)
        return None


def _installed() -> ModuleType | None:
    """``commcheck.native._hot`` where the package was built with it and it is current."""
    if loader.installed_origin("_hot") is None:
        return None
    try:
        mod = importlib.import_module(NAME)
    except ImportError as exc:
        log.warning("commcheck: the installed per-call path cannot be loaded (%s); building "
                    "it now", exc)
        return None
    origin = Path(mod.__file__ or "")
    return mod if loader.current(origin, getattr(mod, "SOURCE_KEY", None), SOURCES) else None


def _build_args() -> tuple:
    """:func:`.loader._build`'s arguments for this extension (also its file name's)."""
    abi = f"{sys.version} {sysconfig.get_config_var('EXT_SUFFIX')}".encode()
    return SOURCE, _flags(), SOURCES[1:], "hot", abi


def _built() -> ModuleType:
    """The first-use build (:func:`.loader._build`), loaded from its checked descriptor."""
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not include.exists():
        raise OSError(f"no Python headers ({include})")
    return private.import_extension(NAME, loader._build(*_build_args()))


def remark_stops() -> bool:
    """Put the stop-signal handler (``mark_stops``) back in front of the dispositions set
    since, for the ring marked last; a handler that restores SIG_DFL and re-raises calls
    this first, so the rank still says it was stopped. Never builds the module."""
    if module.cache_info().currsize == 0:
        return False
    mod = module()
    return bool(mod is not None and mod.mark_stops(None))
