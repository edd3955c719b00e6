"""native Gate (``native/gate.c``): a ProcessGroup method's wrapper whose calls made inside a
wrapped call (the thread's busy flag set) reach torch's method directly, and whose other
calls reach the Python wrapper, bound and forwarded as a Python function would be."""

from __future__ import annotations

import threading

import pytest

from commcheck.native import hot
from commcheck.rank import guard, pgmethods

Gate = getattr(hot.module(), "Gate", None)
pytestmark = pytest.mark.skipif(Gate is None, reason="the native per-call module is not built")


class _Calls:
    def __init__(self) -> None:
        self.orig: list[tuple] = []
        self.slow: list[tuple] = []

    def orig_fn(self, *args, **kwargs):
        self.orig.append((args, kwargs))
        return "orig"

    def slow_fn(self, *args, **kwargs):
        self.slow.append((args, kwargs))
        return "slow"


def _owner(calls: _Calls, local: threading.local) -> tuple[type, object]:
    calls.slow_fn.__func__.marker = "the wrapper's"  # type: ignore[attr-defined]

    class Owner:
        m = Gate(calls.orig_fn, calls.slow_fn, local)

    return Owner, Owner()


def test_busy_flag_picks_the_callee_and_self_is_bound() -> None:
    calls, local = _Calls(), threading.local()
    Owner, obj = _owner(calls, local)
    assert obj.m(1, k=2) == "slow"  # the flag not set on this thread yet
    local.busy = True
    assert obj.m(3) == "orig"
    m = obj.m  # bound outside a call too
    assert m(4, k=5) == "orig"
    local.busy = False
    assert Owner.m(obj, 6) == "slow"  # the class gives the gate itself
    assert calls.slow == [((obj, 1), {"k": 2}), ((obj, 6), {})]
    assert calls.orig == [((obj, 3), {}), ((obj, 4), {"k": 5})]


def test_flag_is_per_thread_and_a_bad_flag_goes_to_the_wrapper() -> None:
    calls, local = _Calls(), threading.local()
    _, obj = _owner(calls, local)
    local.busy = True
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(obj.m()))
    t.start()
    t.join()
    assert seen == ["slow"] and obj.m() == "orig"

    class Unreadable:
        def __bool__(self) -> bool:
            raise RuntimeError("no truth")

    local.busy = Unreadable()
    assert obj.m() == "slow"  # the wrapper reads the flag again and says what is wrong


def test_attributes_are_the_wrappers() -> None:
    calls, local = _Calls(), threading.local()
    Owner, _ = _owner(calls, local)
    g = Owner.__dict__["m"]
    assert g.orig.__func__ is _Calls.orig_fn and g.slow.__func__ is _Calls.slow_fn
    assert g.__name__ == "slow_fn" and g.marker == "the wrapper's"
    with pytest.raises(AttributeError):
        g.nothing_of_that_name  # noqa: B018
    with pytest.raises(TypeError):
        Gate(1, calls.slow_fn, local)
    bare = Gate.__new__(Gate)  # never initialised: errors, not a crash
    with pytest.raises(AttributeError):
        bare.__name__  # noqa: B018
    with pytest.raises(TypeError):
        bare()


def test_process_group_methods_are_gated_on_the_guard() -> None:
    """What patch() installs in front of each method: a gate on guard's own flag, which a
    wrapped dist.* call sets around torch's call."""
    calls = _Calls()
    gated = pgmethods._gated(calls.orig_fn, calls.slow_fn)
    assert type(gated) is Gate
    assert gated("pg") == "slow"
    prev = guard.isolate()
    try:
        assert gated("pg") == "orig"
    finally:
        guard.restore(prev)
    assert gated("pg") == "slow"
