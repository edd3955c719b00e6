"""commcheck's DDP comm hook in C++ (``ddp_hook.cpp``): built before training, then loaded.

A Python comm hook makes DDP's reducer call into Python for every bucket, which costs a
training step far more than the hook's own work (docs/decisions.md, "issue 13: DDP"). The
C++ hook records the same ``ddp_allreduce`` records through the ring's C API
(``ccapi.h``, :mod:`.hot`). It is a torch C++ extension, so it is built with
``torch.utils.cpp_extension`` (a C++ compiler, ninja and the headers in torch's wheel):
about a minute, once per node, torch and source version. That build never runs inside a
rank, where it would hold up the first DDP step for that minute (docs/native.md): ``commcheck
run`` builds it before torchrun starts, ``commcheck build`` for images (:func:`build`); a
rank only loads it (:func:`module`) and, where it is not built, checks the buckets with the
Python hook at once and says so once. The library lives in the private per-user cache the C
kernel uses (:mod:`.private`: owner and mode checked; torch's own ``TORCH_EXTENSIONS_DIR``
under ``/tmp`` is never used: the build gets a private ``build_directory``), named by a key of
its sources, torch, the compiler and Python; builders starting together build it once (the
others wait on a file lock, which the kernel releases if the builder dies). No compiler, no
ninja, no headers, a failed build: one line, and the Python hook. ``COMMCHECK_DDP_NATIVE=0``
forces that.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

from . import private
from .toolchain import compiler_version

log = logging.getLogger("commcheck")

SOURCE = Path(__file__).with_name("ddp_hook.cpp")
HEADER = SOURCE.with_name("ccapi.h")
FLAGS = ("-O2",)
BUILD_TIMEOUT_S = 900  # a loaded 2-core box needs ~1 min; others wait this long for it
ENV = "COMMCHECK_DDP_NATIVE"

_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def module() -> ModuleType | None:
    """The built extension; None (said once in the log) where it is unavailable or not
    built yet. Never builds: a rank does not wait on a compiler."""
    if not enabled():
        return None
    with _lock:  # one load per process, whichever thread asks first
        return _module()


@functools.cache
def _module() -> ModuleType | None:
    try:
        return _load()
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("commcheck: the native DDP hook is unavailable (%s); DDP buckets are "
                    "checked by the Python hook (slower)", text[:300])
        return None


def _compiler() -> str:
    name = os.environ.get("CXX") or "c++"
    found = shutil.which(name)
    if found is None:
        raise OSError(f"no C++ compiler {name!r} on PATH")
    return found


@functools.cache
def _torch_dir() -> Path:
    """torch's package directory, found without importing torch: the launcher asks whether
    the hook is built and should not pay torch's import for it (docs/startup.md)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise OSError("torch is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _include() -> Path:
    return _torch_dir() / "include"


def _torch_build() -> bytes:
    """This torch build, its C++ ABI included, without importing it: its version file
    (version, git commit, CUDA/HIP) and its C++ library's size and time."""
    root = _torch_dir()
    parts = [(root / "version.py").read_bytes()]
    with contextlib.suppress(OSError):
        st = (root / "lib" / "libtorch_cpu.so").stat()
        parts.append(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return b"\0".join(parts)


def key(compiler: str) -> str:
    """What the library depends on: a change of any builds a new one under a new name."""
    parts = [SOURCE.read_bytes(), HEADER.read_bytes(), _torch_build(),
             str(_include()).encode(), compiler.encode(), compiler_version(compiler),
             sys.version.encode(), platform.machine().encode(), " ".join(FLAGS).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def library_name() -> tuple[str, str]:
    """(the extension's name, the compiler it is built with)."""
    compiler = _compiler()
    headers = _include() / "torch/csrc/distributed/c10d"
    if not (headers / "reducer.hpp").exists():
        raise OSError(f"torch's C++ headers are missing ({headers})")
    return f"commcheck_ddp_{key(compiler)}", compiler


def built() -> Path | None:
    """The built library, where there is one in a private cache (no cpp_extension import:
    it pulls in setuptools, ~1 s)."""
    name, _ = library_name()
    for cache in private.cache_dirs(fresh=False, create=False):
        target = cache / f"{name}.so"
        if os.path.lexists(target):
            return target
    return None


def _load() -> ModuleType:
    target = built()
    if target is None:
        raise OSError("not built on this node: `commcheck build` builds it, as `commcheck "
                      "run` does before training")
    return _import(target.stem, target)


def build() -> Path:
    """The library, built now unless it is already; what ``commcheck build`` and ``commcheck
    run`` call before training. Raises OSError saying why it cannot be built."""
    name, compiler = library_name()
    for cache in private.cache_dirs():
        target = cache / f"{name}.so"
        try:
            with private.opened(target, keep=False):
                return target
        except FileNotFoundError:
            pass
        except private.Refused as exc:  # in a directory of ours: replaced by a new build
            private.refuse(f"the native DDP hook {exc}; building a new one")
            os.unlink(target)
        try:
            _cached(cache, name, compiler)
            return target
        except OSError as exc:
            if exc.errno not in private.UNWRITABLE:
                raise
    raise OSError("no private directory to build it in")


def _cached(cache: Path, name: str, compiler: str) -> ModuleType:
    target = cache / f"{name}.so"
    if target.exists():
        return _import(name, target)
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _exclusive(cache / f"{name}.lock"):
        if target.exists():  # another builder finished while this one waited
            return _import(name, target)
        return _build(name, target, compiler)


@contextlib.contextmanager
def _exclusive(path: Path):
    """An flock on ``path``: the kernel drops it when its holder exits, even killed."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(f"another process has been building {path.stem} for "
                                  f"{BUILD_TIMEOUT_S} s") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def _build(name: str, target: Path, compiler: str) -> ModuleType:
    """Compile in a private directory, then rename the library into place (readers never
    see a partial file). Returns the module the build loaded."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise OSError("ninja is not installed")
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=target.parent) as build, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = os.environ.get("CXX")
        os.environ["CXX"] = compiler
        try:
            mod = cpp_extension.load(name, [str(SOURCE)], build_directory=build,
                                     extra_include_paths=[str(SOURCE.parent)],
                                     extra_cflags=list(FLAGS), verbose=False)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            raise OSError(_compile_error(exc)) from None
        finally:
            if env is None:
                os.environ.pop("CXX", None)
            else:
                os.environ["CXX"] = env
        os.chmod(Path(build) / f"{name}.so", 0o700)
        os.replace(Path(build) / f"{name}.so", target)
    return mod


def _compile_error(exc: BaseException) -> str:
    """The first compiler error of a failed build, else the exception's first line."""
    text = str(exc)
    for line in text.splitlines():
        if "error" in line.lower() and ".cpp" in line:
            return line.strip()
    return (text.strip().splitlines() or ["the build failed"])[0]


def _import(name: str, path: Path) -> ModuleType:
    """The extension at ``path``, loaded from its checked descriptor."""
    return private.import_extension(name, path)
