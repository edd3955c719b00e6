"""The exact path: one record at a time, as Python objects — the reference, and the only
place that builds findings.

Per open key it keeps what each member said when it entered the call (:class:`Meta`, from
entry records or, failing those, complete records) and what it reported at completion
(:class:`Obs`). Desync is decided once every member entered (:func:`desync`); values once
every member completed (:class:`Verdicts`, then onsets). ``Engine(fast=False)`` uses this
path alone (the reference the fast path is tested against); otherwise the fast path hands
it what it cannot decide, through :class:`~.handoff.Handoff`, which :class:`ExactPath`
implements. It knows nothing of the fast path.

The exact path is bounded like the fast path (:class:`OpenKeys` keeps the bookkeeping): a
group's open keys span at most ``max_span`` sequence numbers (the newest one it opened and
the ``max_span - 1`` below), and all open keys weigh at most ``max_cells`` cells (a key
weighs its group's size, what its Meta/Obs can grow to). Past either, the oldest keys are
evicted by :meth:`ExactPath.bound` at the end of each ``Engine.ingest_many``
(``EngineStats.evicted``) and records that arrive later for them are dropped
(``EngineStats.late``), never reopened.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from .desync import desync
from .findings import FOLDED, Finding, Kind, NanInf, NanInfCount
from .handoff import HUGE_SEQ, Books, OpenKey, Rows
from .model import Key, Obs, group_label
from .state import EngineStats
from .verdicts import Verdicts

GroupId = tuple[str, str, tuple[int, ...]]  # run, group name, group ranks


class ExactWindow:
    """The exact path's view of one group: what its span bound and late records need."""

    __slots__ = ("gid", "live", "seqs", "top", "floor")

    def __init__(self, gid: GroupId):
        self.gid = gid
        self.top = -1  # the newest seq opened on the exact path
        self.floor = 0  # a record under it whose key is not open is late (evicted past it)
        self.live = 0  # open keys
        self.seqs: list[int] = []  # min-heap of opened seqs; closed ones leave lazily


class OpenKeys(dict[Key, OpenKey]):
    """``ExactPath.open``: the exact path's open keys, with the bookkeeping that bounds them
    — their weight in cells (a key weighs its group's size), their opening order (rows the
    fast path hands over are opened here too, so this order is when a key came to the exact
    path) and, per group, the newest seq and a heap of open seqs. Mutate it with ``[]=``
    and ``del`` only; the bookkeeping is O(1) amortised per opened key (a heap push, which
    is O(1) for seqs that mostly grow)."""

    def __init__(self) -> None:
        super().__init__()
        self.cells = 0
        # (key, born): the OpenKey itself is not kept, so closed keys waiting here to be
        # trimmed hold no Meta/Obs.
        self.order: deque[tuple[Key, int]] = deque()
        self.windows: dict[GroupId, ExactWindow] = {}
        self.grown: dict[int, ExactWindow] = {}  # windows whose top rose since bound()

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        """Pickled (in the collector's snapshot) with its items in the state: pickle's
        default would insert them through ``__setitem__`` before the bookkeeping exists."""
        return OpenKeys, (), {"items": dict(self), **self.__dict__}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        dict.update(self, state.pop("items"))
        self.__dict__.update(state)
        self.grown = {id(w): w for w in self.grown.values()}  # ids of the new objects

    def __setitem__(self, key: Key, open_key: OpenKey) -> None:
        old = self.get(key)
        if old is open_key:
            return
        gid = key[:3]
        w = self.windows.get(gid)
        if w is None:
            w = self.windows[gid] = ExactWindow(gid)
        super().__setitem__(key, open_key)
        self.order.append((key, open_key.born))
        if old is None:
            self.cells += len(key[2])
            w.live += 1
        seq = key[3]
        if seq >= HUGE_SEQ:  # outside any window's arithmetic, as on the fast path
            return
        heapq.heappush(w.seqs, seq)
        if seq > w.top:
            w.top = seq
            self.grown[id(w)] = w
        if len(w.seqs) > 2 * w.live + 64:  # closed keys out of order: compact (amortised)
            w.seqs = sorted({s for s in w.seqs if (*gid, s) in self})

    def __delitem__(self, key: Key) -> None:
        super().__delitem__(key)
        self.cells -= len(key[2])
        self.windows[key[:3]].live -= 1

    def late(self, key: Key) -> bool:
        """A key that is not open, under its group's floor: evicted, or passed by one."""
        w = self.windows.get(key[:3])
        return w is not None and key[3] < w.floor

    def current(self, key: Key, born: int) -> OpenKey | None:
        """The open key an entry of ``order`` stands for, or None once it closed (a key
        reopened later is another opening, with another born ticket)."""
        open_key = self.get(key)
        return open_key if open_key is not None and open_key.born == born else None

    def trim(self) -> None:
        """Drop closed keys from the opening order (all of them once it is mostly stale)."""
        order = self.order
        while order and self.current(*order[0]) is None:
            order.popleft()
        if len(order) > 2 * len(self) + 1024:
            self.order = deque(e for e in order if self.current(*e) is not None)


@dataclass
class Onset:
    """The first finding of a kind that, once true, stays true for a group (NaN/Inf on the
    wire, a diverged replica): later occurrences are counted here instead of repeated."""

    finding: Finding
    folded: int = 0

    def fold(self) -> None:
        self.folded += 1
        setattr(self.finding.detail, FOLDED[self.finding.kind], self.folded)


class ExactPath:
    """Open keys as :class:`OpenKey` objects, decided record by record (a :class:`Handoff`)."""

    def __init__(self, stats: EngineStats, max_span: int, max_cells: int):
        """``stats``: the engine's counters, which this path adds to; ``max_span`` (a power
        of two) and ``max_cells`` bound the open keys."""
        self.stats = stats
        self.max_span = max_span
        self.max_cells = max_cells
        self.open = OpenKeys()
        self.onsets: dict[tuple[str, str, str, tuple[int, ...]], Onset] = {}

    # -- the Handoff ---------------------------------------------------------------------------

    def is_open(self, key: Key) -> bool:
        return key in self.open

    def take_over(self, key: Key, open_key: OpenKey, findings: list[Finding]) -> None:
        self.open[key] = open_key
        self._check_desync(key, open_key, findings)

    def record(self, rows: Rows, i: int, ticket: int, wid: int, books: Books,
               findings: list[Finding]) -> bool:
        """Record ``i`` of a batch; True when it closed its key."""
        key = rows.key(i)
        open_key = self.open.get(key)
        if open_key is None and self.open.late(key):  # its key was evicted: never reopen it
            self.stats.late += 1
            return False
        if open_key is None:
            open_key = self.open[key] = OpenKey(born=ticket, wid=wid)
        rank, meta = rows.env.rank, rows.meta(i)
        if rank not in open_key.entered:
            open_key.entered[rank] = meta
            books.entered(rank, key, meta, ticket)
        self._check_desync(key, open_key, findings)
        if rows.is_entry(i):
            return False
        obs = open_key.complete[rank] = rows.obs(i, meta)
        books.completed(rank, key, meta, obs.t_done, ticket)
        return self._close_if_complete(key, open_key, findings)

    def close_if_complete(self, key: Key, findings: list[Finding]) -> bool:
        return self._close_if_complete(key, self.open[key], findings)

    def decide(self, key: Key, complete: dict[int, Obs]) -> list[Finding]:
        run, gname, granks, seq = key
        self.stats.verified += 1
        for op in {o.op for o in complete.values()}:  # a p2p message: its send and its recv
            self.stats.verified_op(op)
        verdicts = Verdicts(run, group_label(gname, granks), seq, complete)
        if any(o.in_nan or o.in_inf or o.out_nan or o.out_inf for o in complete.values()):
            found = self._nan_inf(key, verdicts, complete)
            if found is not None:
                return found
        return self._fold_onsets(key, verdicts.decide())

    # -- deciding ------------------------------------------------------------------------------

    def _check_desync(self, key: Key, open_key: OpenKey, findings: list[Finding]) -> None:
        """Once every member entered: do they agree on what they called?"""
        run, gname, granks, seq = key
        if not open_key.desync_checked and len(open_key.entered) == len(granks):
            open_key.desync_checked = True
            found = desync(run, group_label(gname, granks), seq, open_key.entered)
            open_key.desynced = bool(found)
            findings.extend(found)

    def _close_if_complete(self, key: Key, open_key: OpenKey, findings: list[Finding]) -> bool:
        if len(open_key.complete) != len(key[2]):
            return False
        del self.open[key]
        if not open_key.desynced:
            findings.extend(self.decide(key, open_key.complete))
        return True

    def _nan_inf(self, key: Key, verdicts: Verdicts, obs: dict[int, Obs]) -> list[Finding] | None:
        """NaN/Inf on the wire: the first in its scope is a finding (the onset), later ones
        are counted into it. None when only outputs carry them (the verdicts decide)."""
        run, gname, granks, _ = key
        # Per group for collectives; per replica set for probes, where each parameter
        # is a group of its own and the first NaN gradient explains the rest.
        probe = verdicts.spec is not None and not verdicts.spec.input
        scope = f"probe:{verdicts.spec.name}" if probe else gname
        onset = self.onsets.get((Kind.NAN_INF, run, scope, granks))
        if onset is not None:  # a consequence of the first NaN: count, do not repeat
            onset.fold()
            self.stats.nan_folded += 1
            return []
        nan = self._nan_onset(verdicts, obs)
        if nan is not None:
            self.onsets[(Kind.NAN_INF, run, scope, granks)] = Onset(nan)
            return [nan]
        return None

    @staticmethod
    def _nan_onset(verdicts: Verdicts, obs: dict[int, Obs]) -> Finding | None:
        """NaN/Inf in what ranks put on the wire (their inputs; for probes, the tensor)."""
        probe = verdicts.spec is not None and not verdicts.spec.input
        counts = {r: (o.out_nan, o.out_inf) if probe else (o.in_nan, o.in_inf)
                  for r, o in obs.items()}
        senders = sorted(r for r, (n, i) in counts.items() if n or i)
        if not senders:  # NaN appeared in outputs only: a comparison problem, not an onset
            return None
        return verdicts.finding(Kind.NAN_INF, senders, NanInf(
            inputs={str(r): NanInfCount(nan=counts[r][0], inf=counts[r][1]) for r in senders},
            later_collectives_with_nan_inf=0))

    def _fold_onsets(self, key: Key, found: list[Finding]) -> list[Finding]:
        """Kinds that stay true once true (``FOLDED``): the group's first is reported,
        later ones are counted into it."""
        run, gname, granks, _ = key
        reported = []
        for f in found:
            if f.kind not in FOLDED:
                reported.append(f)
                continue
            onset = self.onsets.get((f.kind, run, gname, granks))
            if onset is None:
                self.onsets[(f.kind, run, gname, granks)] = Onset(f)
                setattr(f.detail, FOLDED[f.kind], 0)
                reported.append(f)
            else:
                onset.fold()
        return reported

    # -- the bound -----------------------------------------------------------------------------

    def bound(self) -> list[tuple[int, int]]:
        """Evict keys ``max_span`` or more seqs under their group's newest one, then the
        earliest opened until the open keys weigh at most ``max_cells``. Returns the fast
        path's (window, seq) of each evicted key (it may hold a ring slot for it). Runs once
        per ingest, after the block (the fast path's events may still refer to keys while
        it runs); O(1) amortised per opened key."""
        evicted: list[tuple[int, int]] = []
        self._evict_past_span(evicted)
        self._evict_past_cells(evicted)
        self.open.trim()
        return evicted

    def _evict_past_span(self, evicted: list[tuple[int, int]]) -> None:
        opened = self.open
        for w in opened.grown.values():
            heap, edge = w.seqs, w.top - self.max_span
            while heap:
                key: Key = (*w.gid, heap[0])
                open_key = opened.get(key)
                if open_key is not None and heap[0] > edge:
                    break
                heapq.heappop(heap)
                if open_key is not None:
                    self._evict(key, open_key, evicted)
        opened.grown.clear()

    def _evict_past_cells(self, evicted: list[tuple[int, int]]) -> None:
        opened = self.open
        while opened.cells > self.max_cells and opened.order:
            key, born = opened.order.popleft()
            open_key = opened.current(key, born)
            if open_key is not None:
                self._evict(key, open_key, evicted)

    def _evict(self, key: Key, open_key: OpenKey, evicted: list[tuple[int, int]]) -> None:
        """Drop an open key; records that arrive for it later are late."""
        del self.open[key]
        self.stats.evicted += 1
        seq = key[3]
        if seq >= HUGE_SEQ:
            return
        w = self.open.windows[key[:3]]
        w.floor = max(w.floor, seq + 1)
        evicted.append((open_key.wid, seq))
