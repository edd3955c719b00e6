"""The stop signal a rank got, for its goodbye: hot.c's handler marks it in the ring's
header (async-signal-safe), and a handler installed after ``patch()`` (Lightning's signal
connector) must not hide it, so the mark is put in front again once a second."""

from __future__ import annotations

from ..native import hot as native_hot
from ..wire import Ending
from ..wire.ring import W_SIGNAL
from .ending import ending


def remark() -> None:
    """Put hot.c's handler in front again (3 syscalls)."""
    native_hot.remark_stops()


def ending_with_signal(words, at_exit: bool) -> Ending:  # noqa: ANN001 (the header's words)
    """How the process is ending (rank/ending.py), with the stop signal marked in the ring
    header ``words`` (None: no mark to read). Raises what reading it raised."""
    sig = int(words[W_SIGNAL]) if words is not None else 0
    return ending(at_exit, sig if 0 < sig < 128 else 0)
