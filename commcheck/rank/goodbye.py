"""Adding counts to a rank's goodbye from outside :class:`.Session`, which owns it.

The goodbye's counters live on the session's ring writer, which exists only once the
session started and is out of the session's hands by the time its stop hooks run. So the
session's ``start`` is wrapped (on the instance) to learn each writer it opens, and one stop
hook per writer hands that writer's counters to every registered function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import Session

_HOOKS = "_commcheck_goodbye_hooks"


def on_goodbye(session: Session, fn: Callable[[dict[str, int]], None]) -> None:
    """Call ``fn(counters)`` at the session's stop, before its goodbye is written."""
    hooks: list | None = session.__dict__.get(_HOOKS)
    if hooks is None:
        hooks = session.__dict__[_HOOKS] = []
        _learn_writers(session, hooks)
    hooks.append(fn)


def _learn_writers(session: Session, hooks: list) -> None:
    start = session.start
    seen: list = []

    def started() -> bool:
        ok = start()
        writer = session.sender
        if ok and writer is not None and (not seen or seen[0] is not writer):
            seen[:] = [writer]
            session.on_stop(lambda: _run(session, hooks, writer.counters))
        return ok

    session.start = started  # type: ignore[method-assign]


def _run(session: Session, hooks: list, counters: dict[str, int]) -> None:
    for fn in hooks:
        try:
            fn(counters)
        except Exception as e:
            session.fail(e)
