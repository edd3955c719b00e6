"""Counting the collectives that reach a process group without passing a commcheck wrapper.

DDP's C++ reducer without :func:`commcheck.watch`, direct ``torch.ops.c10d`` calls, C++
extensions, CUDA-graph replays and the functional point-to-point ops of compiled graphs all
call the backend directly, where no wrapper (nor :mod:`.compiled`'s kernels) sees them.
Every c10d backend (gloo, NCCL, UCC) numbers the work it is asked to do
(``_get_sequence_number_for_group``), so commcheck reads that number around each wrapped
call: at the end, the growth of a group's number minus what the wrappers covered is what
commcheck did not see. It is reported as not checked, per group, instead of being guessed
at.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable

import torch.distributed.distributed_c10d as c10d

from ..wire.bypass import causes

NESTED = -1  # enter() inside a covered region: the outer region counts


def _backends(pg: object) -> list[object]:
    seen: dict[int, object] = {}
    for device in pg._device_types:
        be = pg._get_backend(device)
        seen.setdefault(id(be), be)
    return list(seen.values())


def _query(pg: object) -> Callable[[], int] | None:
    """A function returning the sum of ``pg``'s backends' work counters; None where a
    backend keeps none."""
    try:
        funcs = [be._get_sequence_number_for_group for be in _backends(pg)]
        for f in funcs:
            f()
    except Exception:
        return None
    if not funcs:
        return None
    if len(funcs) == 1:
        return funcs[0]
    return lambda: sum(f() for f in funcs)


class _Depth(threading.local):
    depth = 0


class Seen:
    """One process group's entry: how to read its counter, its base, what wrappers covered."""

    __slots__ = ("ref", "query", "base", "covered")

    def __init__(self, pg: object, query: Callable[[], int] | None):
        self.ref = weakref.ref(pg)
        self.query = query
        self.base: int | None = None
        self.covered = 0


class Tally:
    """Per process group: the backend's work counter at first sight, and what wrappers saw.

    A call costs two reads of the backend's counter (~0.3 µs each) and a dict lookup; the
    unseen count is computed only when asked (at stop, or when a group is destroyed).
    """

    def __init__(self) -> None:
        self._seen: dict[int, Seen] = {}  # id(pg) -> entry; the weakref tells reuse apart
        self._settled: dict[str, int] = {}
        self.local = _Depth()  # the calling thread's depth of covered regions (0: none)
        self._ddp: dict[str, int] = {}  # group name -> unseen work known to be DDP's own

    def entry(self, pg: object) -> Seen | None:
        """``pg``'s entry, made at first sight; None for what is not a process group."""
        e = self._seen.get(id(pg))
        if e is not None and e.ref() is pg:
            return e
        if not isinstance(pg, c10d.ProcessGroup):
            return None
        e = self._seen[id(pg)] = Seen(pg, _query(pg))
        return e

    def snapshot(self) -> None:
        """Take the counters of the groups that exist now as their starting point."""
        for pg in list(c10d._world.pg_names):
            e = self.entry(pg)
            if e is not None and e.base is None and e.query is not None:
                with contextlib.suppress(Exception):
                    e.base = e.query()

    def enter(self, pg: object) -> int:
        """Open a covered region on ``pg``; pass the result to :meth:`leave`."""
        local = self.local
        if local.depth:
            return NESTED
        e = self._seen.get(id(pg))
        if e is None or e.ref() is not pg:
            e = self.entry(pg)
        if e is None or e.query is None:
            return NESTED
        try:
            seq = e.query()
        except Exception:
            return NESTED
        local.depth = 1
        return seq

    def leave(self, pg: object, before: int) -> int | None:
        """Close the region; returns how much work the backend was given in it (None:
        not counted here)."""
        if before == NESTED:
            return None
        self.local.depth = 0
        try:
            e = self._seen[id(pg)]
            grown = e.query() - before  # type: ignore[misc]
        except Exception:
            return None
        e.covered += grown
        return grown

    def _seq(self, pg: object) -> int | None:
        """``pg``'s backend work counter now; None where it keeps none."""
        e = self.entry(pg)
        return None if e is None or e.query is None else e.query()

    def add_covered(self, pg: object, n: int) -> None:
        """``n`` collectives on ``pg`` were recorded by a hook that ran outside any wrapper."""
        e = self.entry(pg)
        if e is not None:
            e.covered += n

    def mark(self, pg: object) -> tuple[int, int] | None:
        """Open a region of DDP's own C++ traffic on ``pg`` (construction, bucket rebuild);
        wrappers inside it cover their calls as usual."""
        try:
            seq = self._seq(pg)
        except Exception:
            return None
        return None if seq is None else (seq, self.entry(pg).covered)  # type: ignore[union-attr]

    def own(self, pg: object, mark: tuple[int, int] | None) -> None:
        """Close a :meth:`mark` region: what no wrapper covered in it was DDP's own."""
        if mark is None:
            return
        with contextlib.suppress(Exception):
            n = self._seq(pg) - mark[0] - (self.entry(pg).covered - mark[1])  # type: ignore
            if n > 0:
                name = c10d._world.pg_names[pg]
                self._ddp[name] = self._ddp.get(name, 0) + n

    def ddp_own(self) -> dict[str, int]:
        """Group name -> how many of its unseen collectives were DDP's own C++ traffic."""
        return dict(self._ddp)

    def _unseen(self, pg: object) -> int:
        e = self.entry(pg)
        if e is None or e.query is None:
            return 0
        seq = e.query()
        return max(0, seq - (e.base or 0) - e.covered)

    def settle(self, pg: object) -> None:
        """Count ``pg``'s unseen work now (the group is about to be destroyed)."""
        if isinstance(pg, c10d.ProcessGroup) and pg in c10d._world.pg_names:
            n = self._unseen(pg)
            if n:
                name = c10d._world.pg_names[pg]
                self._settled[name] = self._settled.get(name, 0) + n
            self._seen.pop(id(pg), None)

    def unseen(self) -> dict[str, int]:
        """Group name -> collectives its backend ran that no wrapper saw, this rank."""
        out = dict(self._settled)
        for pg, name in list(c10d._world.pg_names.items()):
            n = self._unseen(pg)
            if n:
                out[name] = out.get(name, 0) + n
        return out


def describe(unseen: dict[str, int], ddp_own: dict[str, int]) -> str:
    """What the unseen collectives were, as far as commcheck can tell."""
    per = ", ".join(f"group {k}: {v}" for k, v in unseen.items())
    return (f"{sum(unseen.values())} collectives bypassed the wrappers and were not checked "
            f"({per}): {causes(unseen, ddp_own)}")
