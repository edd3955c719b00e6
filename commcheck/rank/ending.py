"""How the process is ending, for the goodbye (docs/report-status.md, part 1).

An uncaught exception still runs the exit handlers, so the goodbye arrives from a rank
whose training failed: without saying how the process ends, the report read such a run
clean. ``sys.excepthook`` sees the exception before the exit handlers run (and where
another hook replaced ours later, ``sys.last_value`` still holds what Python printed), and
``threading.excepthook`` an exception that ended another thread; ``sys.exit`` gives the exit
status. Each is chained: the previous hook runs as before, and whatever commcheck does
here never raises (DESIGN.md rule 1). A goodbye said at ``destroy_process_group`` (before
the process ends) sees an exception on its way up through a ``finally`` or ``with``.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType

from ..wire import END_EXCEPTION, END_EXIT, END_SIGNAL, MAX_ERROR_LEN, Ending


class _Seen:
    error = ""  # the uncaught exception of the main thread, "Type: first line"
    code: int | None = None  # the status given to sys.exit
    thread = ""  # the first exception that ended another thread
    hooks: tuple | None = None  # (sys.excepthook, threading.excepthook, sys.exit) replaced
    mine: tuple = ()  # the three that replaced them


def describe(exc: BaseException) -> str:
    """``"RuntimeError: first line of the message"``, at most ``MAX_ERROR_LEN``."""
    text = str(exc).strip().split("\n", 1)[0]
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return out[:MAX_ERROR_LEN]


def _exit_code(code: object) -> int:
    """The status a ``SystemExit(code)`` ends the process with (-1 where not 0..255)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code if 0 <= code <= 255 else -1
    return 1  # a message: printed, status 1


def watch() -> None:
    """Chain the hooks (once; :func:`unwatch` puts the previous ones back)."""
    if _Seen.hooks is not None:
        return
    prev_sys, prev_thread, prev_exit = sys.excepthook, threading.excepthook, sys.exit

    def excepthook(kind: type, exc: BaseException, tb: TracebackType | None) -> None:
        try:
            if not _Seen.error:
                _Seen.error = describe(exc)
        except Exception:  # noqa: BLE001 - a str() that raises: the hook still chains
            _Seen.error = getattr(kind, "__name__", "exception")
        prev_sys(kind, exc, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        try:
            if not _Seen.thread and args.exc_value is not None and \
                    not isinstance(args.exc_value, SystemExit):
                name = args.thread.name if args.thread is not None else "?"
                _Seen.thread = f"thread {name}: {describe(args.exc_value)}"[:MAX_ERROR_LEN]
        except Exception:  # noqa: BLE001, S110 - never raise from a hook
            pass
        prev_thread(args)

    def exit(status: object = None) -> None:  # noqa: A001 - sys.exit's own name
        if threading.current_thread() is threading.main_thread():
            _Seen.code = _exit_code(status)
        prev_exit(status)

    _Seen.hooks = (prev_sys, prev_thread, prev_exit)
    _Seen.mine = (excepthook, thread_hook, exit)
    sys.excepthook, threading.excepthook, sys.exit = _Seen.mine


def unwatch() -> None:
    """Put back what :func:`watch` replaced, where nobody replaced it since."""
    if _Seen.hooks is None:
        return
    prev_sys, prev_thread, prev_exit = _Seen.hooks
    mine_sys, mine_thread, mine_exit = _Seen.mine
    _Seen.hooks, _Seen.mine = None, ()
    if sys.excepthook is mine_sys:
        sys.excepthook = prev_sys
    if threading.excepthook is mine_thread:
        threading.excepthook = prev_thread
    if sys.exit is mine_exit:
        sys.exit = prev_exit


def ending(at_exit: bool, signal: int = 0) -> Ending:
    """How the process is ending now: ``at_exit`` from the exit handlers (the script is
    over), else from ``destroy_process_group`` (an exception on its way up is the ending;
    otherwise the status is not known yet). The status is -1 unless ``sys.exit`` gave it.
    ``signal``: the stop signal the process got (the ring's mark), 0 if none."""
    error, code = _Seen.error, _Seen.code
    if not error and at_exit:  # a hook set after ours: Python keeps what it printed
        last = getattr(sys, "last_value", None)
        if isinstance(last, BaseException) and not isinstance(last, SystemExit):
            error = describe(last)
    if not error and not at_exit:
        exc = sys.exc_info()[1]
        if isinstance(exc, SystemExit):
            code = _exit_code(exc.code)
        elif exc is not None:
            error = describe(exc)
    if error:
        return Ending(how=END_EXCEPTION, signal=signal, error=error, thread=_Seen.thread)
    if code is None:  # the script's end and a bare ``raise SystemExit(n)`` look alike
        code = -1
    how = END_SIGNAL if signal else END_EXIT
    return Ending(how=how, code=code, signal=signal, thread=_Seen.thread)
