"""Files the views write for their user (a trace, an HTML report): private (0600, like
every file commcheck leaves), and whole or absent — written beside the target and renamed
onto it only once complete, so an interrupted write never leaves half a file to open.
A target that is not a file (``/dev/stdout``, a pipe, a device) is written in place:
renaming onto it would replace it, and root may."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def private_output(path: str) -> Iterator[BinaryIO]:
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
