"""Functional collectives (``torch.distributed._functional_collectives``, used by DTensor and
tensor parallelism).

They bypass the c10d Python API: each issues a ``torch.ops._c10d_functional`` op and returns
an ``AsyncCollectiveTensor`` that calls ``wait_tensor`` on first use. commcheck wraps the
module's Python functions (DTensor calls them as ``funcol.<name>`` at call time) and records
each under the canonical c10d name with the same semantics. The output is fingerprinted when
the result is waited through ``funcol.wait_tensor`` (what the AsyncCollectiveTensor does),
never by forcing a wait; a result that is never waited that way is counted as not checked at
shutdown. Under Dynamo, export or any other tracer the wrappers reduce to the original call,
so nothing of commcheck enters a graph: collectives inside compiled code are recorded at the
dispatcher instead (:mod:`.compiled`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from ..wire.ops import FUNCOL_OPS
from . import guard
from .install import Installer, binder
from .session import Call, Session
from .wrap import wrap

MAX_UNWAITED = 4096  # unwaited results kept for fingerprinting; beyond, counted not checked


class Unwaited:
    """Functional-collective calls whose result is not waited yet, by result storage."""

    def __init__(self, session: Session):
        self.session = session
        self.calls: dict[int, list[Call]] = {}
        self.waiting: dict[int, list[int]] = {}  # id(call) -> its keys, until one is waited
        self.lock = threading.Lock()
        self.count = 0

    def add(self, keys: list[int], call: Call) -> None:
        with self.lock:
            if self.count >= MAX_UNWAITED:
                self.session.not_checked += 1
                return
            for key in keys:
                self.calls.setdefault(key, []).append(call)
            self.waiting[id(call)] = keys
            self.count += 1

    def pop(self, key: int) -> list[Call]:
        """The calls completed by waiting ``key`` (each once, though it has several keys)."""
        with self.lock:
            done = self.calls.pop(key, [])
            for call in done:
                for other in self.waiting.pop(id(call)):
                    rest = [c for c in self.calls.get(other, ()) if c is not call]
                    if rest:
                        self.calls[other] = rest
                    else:
                        self.calls.pop(other, None)
            self.count -= len(done)
            return done

    def finish(self, tensor: torch.Tensor) -> None:
        """``tensor`` was waited: finish the calls whose result it is (the waiter's
        ``after``; what goes wrong is commcheck's, counted, never raised)."""
        if not self.count:
            return
        try:
            for call in self.pop(_key(tensor)):
                self.session.finish(call)
        except Exception as e:
            self.session.fail(e)

    def track(self, call: Call, result: object) -> object:
        """The wrapper's ``after``: finish ``call`` now, or when its result is waited."""
        call.record.t_exit = time.time()
        call.output = _plain(result)
        waiting = _waiting(result)
        if waiting:
            self.add([_key(t) for t in waiting], call)
        else:
            self.session.finish(call)
        return result

    def abandon(self) -> None:
        """At shutdown: results never waited through funcol cannot be trusted; count them."""
        with self.lock:
            self.session.not_checked += self.count
            self.calls.clear()
            self.waiting.clear()
            self.count = 0


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _plain(t: object) -> object:
    """The tensor under an AsyncCollectiveTensor (reading it must not trigger a wait)."""
    if isinstance(t, list):
        return [_plain(x) for x in t]
    return t.elem if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _waiting(result: object) -> list[torch.Tensor]:
    """The not yet waited tensors of a result: a coalesced op completes all of its results
    with its one work, so waiting any of them completes the call."""
    items = result if isinstance(result, list) else [result]
    return [t.elem for t in items
            if isinstance(t, funcol.AsyncCollectiveTensor) and not t.completed]


def _binder(orig: Callable) -> Callable[[tuple, dict], dict | None]:
    """Arguments by name, with ``group`` resolved to the ProcessGroup it names."""
    bind = binder(orig)

    def bind_group(args: tuple, kwargs: dict) -> dict | None:
        bound = bind(args, kwargs)
        if bound is not None:
            bound["group"] = c10d._resolve_process_group(
                funcol._resolve_group_name(bound["group"], bound.get("tag") or ""))
        return bound

    return bind_group


def _wait(orig: Callable, unwaited: Unwaited) -> Callable:
    @functools.wraps(orig)
    def wait_tensor(tensor):
        if guard.compiling():
            return orig(tensor)
        out = orig(tensor)
        unwaited.finish(tensor)
        return out

    wait_tensor.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return wait_tensor


def install(session: Session, installer: Installer) -> None:
    unwaited = Unwaited(session)
    for spec in FUNCOL_OPS:
        for name in (spec.name, *spec.aliases):
            fn = getattr(funcol, name, None)
            if fn is not None:
                # SKIP cannot be honoured: a functional result cannot be faked
                installer.set(funcol, name, wrap(fn, session, spec, bind=_binder(fn),
                                                 after=unwaited.track, rebind=True,
                                                 aside=guard.nested_compiling_or_tracing))
    installer.set(funcol, "wait_tensor", _wait(funcol.wait_tensor, unwaited))
    session.on_stop(unwaited.abandon)
