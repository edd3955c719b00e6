"""Draining the gradient probe's writers when the process ends without ``stop()``.

msprobe writes every step even when a script never calls ``debugger.stop()`` (many omit it,
or die before it), so the writer must not lose queued steps at exit: at interpreter exit
every live writer is drained; on SIGTERM or SIGINT the queued steps are written first, then
the handler that was there before runs (chained, so torchrun's and frameworks' handling is
unchanged: a default SIGTERM still ends the process by that signal). Handlers are only ever
installed from the main thread. Only SIGKILL can lose queued steps; the writer's marker file
(see :mod:`.writer`) lets the next run say so.

Nothing here takes a lock the interrupted main thread might hold: waiting for a writer
polls its queue's counter, bounded by a timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Protocol

from ..native import hot as native_hot

log = logging.getLogger("commcheck.gradprobe")
EXIT_TIMEOUT_S = 60.0  # at most this long at interpreter exit
SIGNAL_TIMEOUT_S = 20.0  # torchrun's grace period before SIGKILL is 30 s by default
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Drainable(Protocol):
    def wait_idle(self, timeout: float) -> bool: ...
    def stop(self, timeout: float | None = None) -> bool: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_previous: dict[int, Any] = {}
_lock = threading.Lock()
_atexit_done = False


def register(writer: Drainable) -> None:
    """Drain ``writer`` at exit and on SIGTERM/SIGINT until :func:`unregister`."""
    global _atexit_done
    with _lock:
        _live.add(writer)
        if not _atexit_done:
            atexit.register(drain_all)
            _atexit_done = True
    install_handlers()


def unregister(writer: Drainable) -> None:
    _live.discard(writer)


def drain_all(timeout: float = EXIT_TIMEOUT_S) -> None:
    """Stop every live writer after it wrote what was queued (interpreter exit)."""
    for writer in list(_live):
        try:
            if not writer.stop(timeout):
                log.warning("gradprobe: writer still busy after %.0f s at exit; "
                            "steps still queued are lost", timeout)
        except Exception as exc:  # never raise at exit
            log.error("gradprobe: draining the writer at exit failed: %s", exc)


def install_handlers() -> bool:
    """Chain a draining handler before SIGTERM's and SIGINT's; only from the main thread,
    once. False where it cannot (another thread, or no signals here)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in SIGNALS:
        if sig in _previous:
            continue
        try:
            prev = signal.getsignal(sig)
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main interpreter, or no such signal
            return False
        _previous[sig] = prev
    return True


def _on_signal(signum: int, frame: FrameType | None) -> Any:
    prev = _previous.get(signum)
    dies = prev in (signal.SIG_DFL, None)
    for writer in list(_live):
        try:
            done = writer.stop(SIGNAL_TIMEOUT_S) if dies else writer.wait_idle(SIGNAL_TIMEOUT_S)
            if not done:
                log.warning("gradprobe: writer still busy %.0f s after signal %d; steps "
                            "still queued may be lost", SIGNAL_TIMEOUT_S, signum)
        except Exception as exc:
            log.error("gradprobe: draining the writer on signal %d failed: %s", signum, exc)
    if callable(prev):
        return prev(signum, frame)
    if prev == signal.SIG_IGN:
        return None
    signal.signal(signum, signal.SIG_DFL)  # end by the signal, as without commcheck
    with contextlib.suppress(Exception):
        native_hot.remark_stops()  # the ring still learns it was stopped (hot.c)
    os.kill(os.getpid(), signum)
    return None
