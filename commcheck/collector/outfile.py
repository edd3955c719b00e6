"""Files the views write for their user (a trace, an HTML report): private (0600, like
every file commcheck leaves), and whole or absent — written beside the target and renamed
onto it only once complete, so an interrupted write never leaves half a file to open."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def private_output(path: str) -> Iterator[BinaryIO]:
    tmp = f"{path}.partial"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as out:
            yield out
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
