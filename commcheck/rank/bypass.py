"""Counting the collectives that reach a process group without passing a commcheck wrapper.

Compiled graphs (Dynamo lowers ``dist.*`` to ``torch.ops._c10d_functional`` ops), DDP's C++
reducer without :func:`commcheck.watch`, direct ``torch.ops`` calls and C++ extensions all
call the backend directly, where no Python wrapper can see them. Every c10d backend (gloo,
NCCL, UCC) numbers the work it is asked to do (``_get_sequence_number_for_group``), so
commcheck reads that number around each wrapped call: at the end, the growth of a group's
number minus what the wrappers covered is what commcheck did not see. It is reported as
not checked, per group, instead of being guessed at.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch.distributed.distributed_c10d as c10d

NESTED = -1  # enter() inside a covered region: the outer region counts


def _backends(pg: object) -> list[object]:
    seen: dict[int, object] = {}
    for device in pg._device_types:
        be = pg._get_backend(device)
        seen.setdefault(id(be), be)
    return list(seen.values())


class Tally:
    """Per process group: the backend's work counter at first sight, and what wrappers saw."""

    def __init__(self) -> None:
        self._base: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._covered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._settled: dict[str, int] = {}
        self._local = threading.local()
        self._ddp: dict[str, int] = {}  # group name -> unseen work known to be DDP's own

    def _seq(self, pg: object) -> int | None:
        """The sum of the backends' work counters; None where a backend keeps none."""
        backends = self._backends.get(pg)
        if backends is None:
            try:
                backends = _backends(pg)
                for be in backends:
                    be._get_sequence_number_for_group()
            except Exception:
                backends = []
            self._backends[pg] = backends
        if not backends:
            return None
        return sum(be._get_sequence_number_for_group() for be in backends)

    def snapshot(self) -> None:
        """Take the counters of the groups that exist now as their starting point."""
        for pg in list(c10d._world.pg_names):
            if pg not in self._base:
                seq = self._seq(pg)
                if seq is not None:
                    self._base[pg] = seq

    def enter(self, pg: object) -> int:
        """Open a covered region on ``pg``; pass the result to :meth:`leave`."""
        if getattr(self._local, "depth", 0) or not isinstance(pg, c10d.ProcessGroup):
            return NESTED
        self._local.depth = 1
        try:
            seq = self._seq(pg)
        except Exception:
            seq = None
        if seq is None:
            self._local.depth = 0
            return NESTED
        return seq

    def leave(self, pg: object, before: int) -> None:
        if before == NESTED:
            return
        self._local.depth = 0
        with contextlib.suppress(Exception):
            self._covered[pg] = self._covered.get(pg, 0) + self._seq(pg) - before

    def add_covered(self, pg: object, n: int) -> None:
        """``n`` collectives on ``pg`` were recorded by a hook that ran outside any wrapper."""
        with contextlib.suppress(Exception):
            self._covered[pg] = self._covered.get(pg, 0) + n

    def mark(self, pg: object) -> tuple[int, int] | None:
        """Open a region of DDP's own C++ traffic on ``pg`` (construction, bucket rebuild);
        wrappers inside it cover their calls as usual."""
        try:
            seq = self._seq(pg)
        except Exception:
            return None
        return None if seq is None else (seq, self._covered.get(pg, 0))

    def own(self, pg: object, mark: tuple[int, int] | None) -> None:
        """Close a :meth:`mark` region: what no wrapper covered in it was DDP's own."""
        if mark is None:
            return
        with contextlib.suppress(Exception):
            n = self._seq(pg) - mark[0] - (self._covered.get(pg, 0) - mark[1])
            if n > 0:
                name = c10d._world.pg_names[pg]
                self._ddp[name] = self._ddp.get(name, 0) + n

    def ddp_own(self) -> dict[str, int]:
        """Group name -> how many of its unseen collectives were DDP's own C++ traffic."""
        return dict(self._ddp)

    def _unseen(self, pg: object) -> int:
        seq = self._seq(pg)
        if seq is None:
            return 0
        return max(0, seq - self._base.get(pg, 0) - self._covered.get(pg, 0))

    def settle(self, pg: object) -> None:
        """Count ``pg``'s unseen work now (the group is about to be destroyed)."""
        if isinstance(pg, c10d.ProcessGroup) and pg in c10d._world.pg_names:
            n = self._unseen(pg)
            if n:
                name = c10d._world.pg_names[pg]
                self._settled[name] = self._settled.get(name, 0) + n
            self._base.pop(pg, None)
            self._covered.pop(pg, None)

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
    total, own = sum(unseen.values()), sum(min(ddp_own.get(g, 0), n) for g, n in unseen.items())
    per = ", ".join(f"group {k}: {v}" for k, v in unseen.items())
    head = f"{total} collectives bypassed the wrappers and were not checked ({per})"
    ddp = ("DDP's own C++ traffic (construction: parameter check and state broadcast; "
           "bucket rebuild)")
    other = ("torch.compile graphs, a DDP model built before patch() or with COMMCHECK_DDP=0 "
             "and not watched, built-in comm hooks of such a model, or C++/torch.ops callers")
    if own >= total:
        return f"{head}: all {ddp}"
    if own:
        return f"{head}: {own} {ddp}; {total - own} from {other}"
    return f"{head}: {other}"
