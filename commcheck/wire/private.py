"""Files and folders commcheck keeps on a node are the job user's alone: one set of checks
for every side (a rank's ring, the relay's lock, log, dump and spill files, what ``analyze``
finds in a directory), so the ranks and the relay can never disagree about what is safe.

On a shared node another user can create any name in a shared directory (``/dev/shm``,
``/tmp``) before we do, and can rename or replace entries of a directory others may write
into without the sticky bit. So a file is used only when it is a regular file we own that
nobody else can read or write, a folder only when we own it (or root does) and nobody else
can swap its entries; a name someone else holds is never fought over: a fresh private one
is made beside it. docs/security.md has the threat model.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .._owner import FOREIGN, NOT_DIR, dir_fault

# A rank's goodbye counter ``refused_file:<path>: <why>`` = 1: another user's file stood in
# its way (it recorded elsewhere). Not the collector's ``refused:<reason>:<who>``, which
# counts refused senders.
REFUSED_FILE = "refused_file:"


class NotPrivate(ValueError):
    """A file or folder that is not the user's alone (another user's, or open to others)."""


def file_problem(st: os.stat_result) -> str:
    """Why a file (its ``lstat``/``fstat``) is not ours alone; "" when it is."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not ours ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"mode {st.st_mode & 0o777:o}, expected 600"
    return ""


def dir_problem(st: os.stat_result, strict: bool = False) -> str:
    """Why a folder may not hold our files; "" when it may. Ours, or root's (``/dev/shm``,
    ``/tmp``), and nobody else may swap its entries: not writable by others unless sticky.
    ``strict`` (a folder of our own, such as a run's dump folder): ours, and nobody else
    may write into it at all."""
    uid = os.getuid()
    fault = dir_fault(st, uid, root=not strict, sticky=not strict)
    if not fault or fault == NOT_DIR:
        return fault
    if fault == FOREIGN:
        return f"owned by uid {st.st_uid}, not ours ({uid})"
    return f"mode {st.st_mode & 0o7777:o}: others may write into it" + \
        ("" if strict else " and it has no sticky bit")


def name_problem(path: str) -> str:
    """Why the name ``path`` cannot be ours: "" when nothing is there yet or it is a file
    of ours alone, else ``"PATH: why"`` (a symlink, another user's file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"{path}: {e.strerror}"
    why = file_problem(st)
    return f"{path}: {why}" if why else ""


def open_mine(path: str | Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink and refuses (:class:`NotPrivate`) a file we
    do not own or that others may read or write: checked on the open descriptor, so the
    file read is the file checked."""
    fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    why = file_problem(os.fstat(fd))
    if why:
        os.close(fd)
        raise NotPrivate(f"{path}: {why}")
    return fd


@contextlib.contextmanager
def private_output(path: str) -> Iterator[BinaryIO]:
    """A file written for the user (a trace, an HTML report, a ready file): private (0600)
    and whole or absent, written beside the target and renamed onto it only once complete,
    so an interrupted write never leaves half a file and a reader that polls for it never
    sees it empty. A target that is not a file (``/dev/stdout``, a pipe, a device) is
    written in place: renaming onto it would replace it, and root may."""
    if _not_a_file(path):
        with open(path, "wb", buffering=1 << 20) as out:
            yield out
        return
    tmp = f"{path}.partial"
    with contextlib.suppress(FileNotFoundError):  # left by a run killed while writing
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as out:
            yield out
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _not_a_file(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def announce(path: str, line: str) -> None:
    """``line`` as the whole content of ``path`` (:func:`private_output`)."""
    with private_output(path) as out:
        out.write(line.encode() + b"\n")


def usable_base(path: str) -> bool:
    """Whether fresh private folders may be made in ``path`` (it exists, and nobody else
    can swap what we put there)."""
    try:
        return not dir_problem(os.lstat(path))
    except OSError:
        return False


def fresh_dir(bases: list[str], prefix: str) -> str:
    """A new folder only we can enter (0700, a random name nobody could create first), in
    the first of ``bases`` that may hold one. Raises OSError when none can."""
    for base in dict.fromkeys(bases):
        if base and usable_base(base):
            with contextlib.suppress(OSError):
                return tempfile.mkdtemp(prefix=prefix, dir=base)
    raise OSError(f"no private folder could be made in {', '.join(dict.fromkeys(bases))}")


def own_folder(base: str | Path, name: str) -> tuple[Path, str]:
    """``base/name`` for files only we may write and read (a run's dump or spill files),
    created 0700 (``base`` too, where missing). One that exists but is not ours, or that
    others may write into, is never written into nor read: a fresh private folder
    ``base/name-XXXXXXXX`` is made beside it. Returns (the folder, why the usual one was
    passed over or "")."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = base / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
        return path, ""
    why = dir_problem(os.lstat(path), strict=True)
    if not why:
        return path, ""
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base)), f"{path}: {why}"
