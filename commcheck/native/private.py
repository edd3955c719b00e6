"""Where native code may be loaded from: directories and libraries no other user can change.

A library that another local user could write or replace is their code running as the job's
user in every rank (docs/native.md, "Threat model"). So the build cache is used only where
every directory from ``/`` down to it is owned by this user or root and writable by no one
else (a world-writable directory such as ``/tmp`` only with its sticky bit, which stops
others renaming what is ours), and a library is loaded only through a descriptor opened
without following links, after checking that it is a regular file of this user (or root)
that no one else may write. Anything else is refused with one line, once, and the next
place is tried: the cache, then ``$TMPDIR/commcheck-<uid>``, then a fresh private directory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from .._owner import FOREIGN, NOT_DIR, dir_fault

log = logging.getLogger("commcheck")

ENV = "COMMCHECK_CACHE_DIR"
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_said: set[str] = set()


class Refused(OSError):
    """A directory or library another user could have written."""


def refuse(text: str) -> None:
    """One line on stderr (the ``commcheck`` log), once per process and text."""
    if text not in _said:
        _said.add(text)
        log.warning("commcheck: refused %s", text)


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def check_dir(path: Path) -> Path:
    """``path`` resolved, after checking every directory from ``/`` down to it; raises
    :class:`Refused` naming the first one another user could change."""
    real = Path(os.path.realpath(path))
    parts = [real, *real.parents][::-1]
    for i, d in enumerate(parts):
        st = os.stat(d)
        last = i == len(parts) - 1
        fault = dir_fault(st, os.geteuid(), sticky=not last)  # our folder: no other writer
        if fault == NOT_DIR:
            raise Refused(f"{d}: not a directory")
        if fault == FOREIGN:
            raise Refused(f"{d}: owned by uid {st.st_uid}, not by this user (uid "
                          f"{os.geteuid()}) or root")
        if fault:
            if last and st.st_uid == os.geteuid():
                os.chmod(d, 0o700)  # ours: made private again, nothing foreign can be in it
                continue
            raise Refused(f"{d}: writable by other users (mode {stat.S_IMODE(st.st_mode):o})")
    return real


def ensure_dir(path: Path) -> Path:
    """``path`` created private (0700) if missing, then checked as :func:`check_dir` does."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    return check_dir(path)


def default_cache() -> Path:
    """``$COMMCHECK_CACHE_DIR``, else ``$XDG_CACHE_HOME/commcheck`` or ``~/.cache/commcheck``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "commcheck"


def cache_dirs(fresh: bool = True, create: bool = True) -> Iterator[Path]:
    """The private places to keep libraries in, best first: the cache, the per-user temp
    folder, and (``fresh``) a new private directory removed at exit. Each refused or
    unwritable one is skipped (a refusal said once); ``create=False``: so is a missing one
    (to look for a library, not to build one)."""
    for where in (default_cache(), Path(tempfile.gettempdir()) / f"commcheck-{os.getuid()}"):
        if not create and not where.exists():
            continue
        try:
            yield ensure_dir(where)
        except Refused as exc:
            refuse(f"the native build directory {exc}; trying the next place")
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise
    if fresh:
        made = tempfile.mkdtemp(prefix="commcheck-native-")
        atexit.register(shutil.rmtree, made, True)
        yield check_dir(Path(made))


def check_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{path}: not a regular file")
    if not _trusted(st.st_uid):
        raise Refused(f"{path}: owned by uid {st.st_uid}, not by this user or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Refused(f"{path}: writable by other users (mode {stat.S_IMODE(st.st_mode):o})")


_kept: list[int] = []


@contextlib.contextmanager
def opened(path: Path, keep: bool = True) -> Iterator[str]:
    """A name to ``dlopen`` for the library at ``path``: the checked descriptor itself
    (``/proc/self/fd/N``), so the file loaded is the file checked. Raises :class:`Refused`
    for a link, a non-file, or a file another user owns or may write. ``keep``: the
    descriptor stays open once the block ran (the loader knows a library by its name: a
    number used again would hand back the library loaded under it before)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path}: a symbolic link") from None
        raise
    try:
        check_file(fd, path)
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else str(path)
    except BaseException:
        os.close(fd)
        raise
    if keep:
        _kept.append(fd)
    else:
        os.close(fd)


def import_extension(name: str, path: Path) -> ModuleType:
    """The CPython extension ``name`` at ``path``, loaded from the descriptor :func:`opened`
    checked (a library another user could write is refused, never loaded)."""
    with opened(path) as where:
        spec = importlib.util.spec_from_file_location(
            name, where, loader=importlib.machinery.ExtensionFileLoader(name, where))
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    mod.__file__ = str(path)
    return mod
