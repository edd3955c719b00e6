"""Matching records across ranks by (run, group identity, sequence) and deciding.

Per open key the engine keeps what each member said when it entered the call (:class:`Meta`,
from entry records or, failing those, complete records) and what it reported at completion
(:class:`Obs`). Desync is decided once every member entered; values once every member
completed; hangs by :meth:`Engine.check_hangs`, which the collector calls periodically with
the current time. Memory is bounded by the open window, not by the run's length.

Clean traffic takes the vectorised path (``fastpath.py``); this module's per-record path is
the exact one, and the only one that builds findings. ``Engine(fast=False)`` uses it alone
(the reference the fast path is tested against).

The exact path is bounded like the fast path (:class:`OpenKeys` keeps the bookkeeping): a
group's open keys span at most ``max_span`` sequence numbers (the newest one it opened and
the ``max_span - 1`` below), and all open keys weigh at most ``max_exact_cells`` cells (a
key weighs its group's size, what its Meta/Obs can grow to). Past either, the oldest keys
are evicted at the end of :meth:`Engine.ingest_many` (``EngineStats.evicted``) and records
that arrive later for them are dropped (``EngineStats.late``), never reopened.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..wire import GOODBYE, HELLO, PHASE_ENTRY, RECORDS, Batch
from .desync import desync
from .fastpath import DEFAULT_MAX_CELLS, DEFAULT_MAX_SPAN, FastPath
from .handoff import HUGE_SEQ, OnEnter, OpenKey, Rows
from .model import Finding, Key, Meta, Obs, group_label
from .state import EngineStats, RankState
from .verdicts import Verdicts

DEFAULT_HANG_TIMEOUT = 30.0
# The exact path's budget is this share of the fast path's cells: an exact cell (a member's
# Meta + Obs as Python objects) costs up to ~1 KiB against ~230 B for a fast one. The
# default, 2**17 cells, is 65,536 open pairwise keys (~110 MiB measured, a silent peer).
EXACT_CELLS_SHARE = 16

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
    """``Engine.open``: the exact path's open keys, with the bookkeeping that bounds them —
    their weight in cells (a key weighs its group's size), their opening order (the fast
    path converts rows into keys here too, so this order is when a key came to the exact
    path) and, per group, the newest seq and a heap of open seqs. Mutate it with ``[]=``
    and ``del`` only (what the engine and the fast path do); the bookkeeping is O(1)
    amortised per opened key (a heap push, which is O(1) for seqs that mostly grow)."""

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

    def __setitem__(self, key: Key, ok: OpenKey) -> None:
        old = self.get(key)
        if old is ok:
            return
        gid = key[:3]
        w = self.windows.get(gid)
        if w is None:
            w = self.windows[gid] = ExactWindow(gid)
        super().__setitem__(key, ok)
        self.order.append((key, ok.born))
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
        ok = self.get(key)
        return ok if ok is not None and ok.born == born else None

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
        self.finding.detail[FOLDED_KEY[self.finding.kind]] = self.folded


FOLDED_KEY = {"nan_inf": "later_collectives_with_nan_inf", "grad_divergence": "later_steps",
              "param_divergence": "later_steps"}


class Engine:
    def __init__(self, world_size: int = 0, hang_timeout: float = DEFAULT_HANG_TIMEOUT,
                 fast: bool = True, max_open_cells: int = DEFAULT_MAX_CELLS,
                 max_span: int = DEFAULT_MAX_SPAN, max_exact_cells: int | None = None):
        """``max_open_cells`` and ``max_span`` bound the fast path (see fastpath.py);
        ``max_span`` (rounded up to a power of two, as there) and ``max_exact_cells``
        (default ``max_open_cells // EXACT_CELLS_SHARE``) bound the exact path."""
        self.world_size = world_size
        self.hang_timeout = hang_timeout
        self.ranks: dict[int, RankState] = {}
        self.open = OpenKeys()
        self.max_span = 1 << max(3, (max_span - 1).bit_length())
        self.max_exact_cells = (max_open_cells // EXACT_CELLS_SHARE if max_exact_cells is None
                                else max_exact_cells)
        self.stats = EngineStats(world=world_size)
        self.runs: set[str] = set()
        self.onsets: dict[tuple[str, str, str, tuple[int, ...]], Onset] = {}
        self.fast = FastPath(self, max_open_cells, max_span) if fast else None
        self._ticket = 1

    @property
    def done(self) -> bool:
        """Every expected rank said goodbye."""
        n = self.world_size or max((r + 1 for r in self.ranks), default=0)
        return n > 0 and sum(s.goodbye for s in self.ranks.values()) >= n

    def next_tickets(self, n: int) -> int:
        """Reserve ``n`` arrival tickets (a global record order); returns the first."""
        t = self._ticket
        self._ticket += n
        return t

    def ingest(self, batch: Batch) -> list[Finding]:
        return self.ingest_many([batch])

    def ingest_many(self, batches: list[Batch]) -> list[Finding]:
        """Ingest batches in order; the same result as ingesting them one by one, but the
        fast path decides their records as one block."""
        items = []
        for batch in batches:
            state = self._envelope(batch)
            if batch.env.kind == RECORDS and len(batch.records):
                state.records += len(batch.records)
                self.stats.records += len(batch.records)
                items.append((batch, state))
        if not items:
            return []
        if self.fast is not None:
            findings = self.fast.ingest(items)
        else:
            findings = []
            for batch, _ in items:
                rows = Rows(batch)
                t0 = self.next_tickets(len(batch.records))
                for i in range(len(batch.records)):
                    self._record(rows, i, t0 + i, -1, self.set_last, findings)
        self._bound()
        self.stats.open_keys = self.unmatched()
        self.stats.findings += len(findings)
        return findings

    def _envelope(self, batch: Batch) -> RankState:
        env = batch.env
        state = self.ranks.get(env.rank)
        if state is None:
            state = self.ranks[env.rank] = RankState(env.host, env.node)
        state.host, state.last_t = env.host, max(state.last_t, env.t)
        state.run = env.run
        if env.counters:
            state.counters.update(env.counters)
        if env.world and not self.world_size:
            self.world_size = self.stats.world = env.world
        self.runs.add(env.run)
        if env.kind == HELLO:
            state.hello = True
        elif env.kind == GOODBYE:
            state.goodbye = True
        return state

    def set_last(self, rank: int, gname: str, granks: tuple[int, ...], seq: int,
                 meta: Meta, ticket: int = 0) -> None:
        """Remember a rank's latest entry (by t_enter) for missing_rank details."""
        state = self.ranks[rank]
        if state.last is None or meta.t_enter >= state.last[1].t_enter:
            state.last = (f"{group_label(gname, granks)} seq {seq}", meta)

    def _record(self, rows: Rows, i: int, ticket: int, wid: int, on_enter: OnEnter,
                findings: list[Finding]) -> None:
        """The exact path for record ``i`` of a batch."""
        env, s, cols, shapes = rows.env, rows.env.strings, rows.cols, rows.shapes
        gname, granks = rows.groups[cols["group"][i]]
        key: Key = (env.run, gname, granks, cols["seq"][i])
        o1 = cols["shape_off"][i]
        o2 = o1 + cols["in_ndim"][i]
        o3 = o2 + cols["out_ndim"][i]
        o4 = o3 + cols["in_splits_n"][i]
        in_shape, out_shape = tuple(shapes[o1:o2]), tuple(shapes[o2:o3])
        in_splits, out_splits = tuple(shapes[o3:o4]), \
            tuple(shapes[o4:o4 + cols["out_splits_n"][i]])
        meta = Meta(env.rank, env.host, s[cols["op"][i]], s[cols["dtype"][i]],
                    cols["numel_in"][i], cols["numel_out"][i], in_shape, out_shape,
                    s[cols["redop"][i]], cols["root"][i], cols["peer"][i], in_splits,
                    out_splits, s[cols["callsite"][i]], cols["step"][i],
                    cols["t_enter"][i])
        ok = self.open.get(key)
        if ok is None and self.open.late(key):  # its key was evicted: never reopen it
            self.stats.late += 1
            return
        if ok is None:
            ok = self.open[key] = OpenKey(born=ticket, wid=wid)
            if self.fast is not None:
                self.fast.opened(ok, key[3])
        if env.rank not in ok.entered:
            ok.entered[env.rank] = meta
            on_enter(env.rank, gname, granks, key[3], meta, ticket)
        if not ok.desync_checked and len(ok.entered) == len(granks):
            ok.desync_checked = True
            found = desync(env.run, group_label(gname, granks), key[3], ok.entered)
            ok.desynced = bool(found)
            findings.extend(found)
        if cols["phase"][i] == PHASE_ENTRY:
            return
        off, n = cols["chunk_off"][i], cols["chunk_n"][i]
        ok.complete[env.rank] = Obs(
            env.rank, env.host, meta.op, meta.dtype, meta.redop, meta.root,
            s[cols["algo"][i]], meta.callsite, cols["flags"][i], meta.numel_in,
            meta.numel_out, meta.step, cols["t_done"][i],
            (cols["in_h0"][i], cols["in_h1"][i]), (cols["out_h0"][i], cols["out_h1"][i]),
            cols["in_sum"][i], cols["in_absmax"][i], cols["in_nan"][i], cols["in_inf"][i],
            cols["out_sum"][i], cols["out_absmax"][i], cols["out_nan"][i],
            cols["out_inf"][i], tuple(rows.chunks[off:off + n]),
        )
        if len(ok.complete) == len(granks):
            del self.open[key]
            if self.fast is not None:
                self.fast.closed(ok, key[3])
            if not ok.desynced:
                findings.extend(self._decide(key, ok.complete))

    def _bound(self) -> None:
        """Evict exact-path keys ``max_span`` or more seqs under their group's newest one,
        then the earliest opened until the open keys weigh at most ``max_exact_cells``.
        Runs once per ingest, after the block (the fast path's events may still refer to
        keys while it runs); O(1) amortised per opened key."""
        op = self.open
        for w in op.grown.values():
            heap, edge = w.seqs, w.top - self.max_span
            while heap:
                key: Key = (*w.gid, heap[0])
                ok = op.get(key)
                if ok is not None and heap[0] > edge:
                    break
                heapq.heappop(heap)
                if ok is not None:
                    self._evict(key, ok)
        op.grown.clear()
        while op.cells > self.max_exact_cells and op.order:
            key, born = op.order.popleft()
            ok = op.current(key, born)
            if ok is not None:
                self._evict(key, ok)
        op.trim()

    def _evict(self, key: Key, ok: OpenKey) -> None:
        """Drop an open key; records that arrive for it later are late."""
        del self.open[key]
        self.stats.evicted += 1
        seq = key[3]
        if seq >= HUGE_SEQ:
            return
        w = self.open.windows[key[:3]]
        w.floor = max(w.floor, seq + 1)
        fp = self.fast
        if fp is not None and fp.ring_pos(ok.wid, seq) >= 0:
            # Free the ring slot the key held and raise the window's floor, as the fast
            # path's own eviction does, so a later record is late instead of a new row.
            fp.closed(ok, seq)
            fp.rings.floor[ok.wid] = max(int(fp.rings.floor[ok.wid]), seq + 1)

    def _decide(self, key: Key, obs: dict[int, Obs]) -> list[Finding]:
        run, gname, granks, seq = key
        self.stats.verified += 1
        verdicts = Verdicts(run, group_label(gname, granks), seq, obs)
        if any(o.in_nan or o.in_inf or o.out_nan or o.out_inf for o in obs.values()):
            # Per group for collectives; per replica set for probes, where each parameter
            # is a group of its own and the first NaN gradient explains the rest.
            probe = verdicts.spec is not None and not verdicts.spec.input
            scope = f"probe:{verdicts.spec.name}" if probe else gname
            onset = self.onsets.get(("nan_inf", run, scope, granks))
            if onset is not None:  # a consequence of the first NaN: count, do not repeat
                onset.fold()
                self.stats.nan_folded += 1
                return []
            nan = self._nan_onset(verdicts, obs)
            if nan is not None:
                self.onsets[("nan_inf", run, scope, granks)] = Onset(nan)
                return [nan]
        found = []
        for f in verdicts.decide():
            if f.kind not in FOLDED_KEY:
                found.append(f)
                continue
            onset = self.onsets.get((f.kind, run, gname, granks))
            if onset is None:
                self.onsets[(f.kind, run, gname, granks)] = Onset(f)
                f.detail[FOLDED_KEY[f.kind]] = 0
                found.append(f)
            else:
                onset.fold()
        return found

    @staticmethod
    def _nan_onset(verdicts: Verdicts, obs: dict[int, Obs]) -> Finding | None:
        """NaN/Inf in what ranks put on the wire (their inputs; for probes, the tensor)."""
        probe = verdicts.spec is not None and not verdicts.spec.input
        counts = {r: (o.out_nan, o.out_inf) if probe else (o.in_nan, o.in_inf)
                  for r, o in obs.items()}
        senders = sorted(r for r, (n, i) in counts.items() if n or i)
        if not senders:  # NaN appeared in outputs only: a comparison problem, not an onset
            return None
        return verdicts.finding("nan_inf", senders, {
            "inputs": {str(r): {"nan": counts[r][0], "inf": counts[r][1]} for r in senders},
            "later_collectives_with_nan_inf": 0,
        })

    def check_hangs(self, now: float, final: bool = False) -> list[Finding]:
        """``missing_rank`` for collectives some members entered ``hang_timeout`` s ago
        while others never did; at the end of a run (``final``) regardless of time."""
        cands: list[tuple[int, Key, OpenKey, Callable[[], None] | None]] = [
            (ok.born, key, ok, None) for key, ok in self.open.items()]
        if self.fast is not None:
            cands += self.fast.hang_candidates(now, final, self.hang_timeout)
            cands.sort(key=lambda c: c[0])
        found = []
        for _, (run, gname, granks, seq), ok, mark in cands:
            if ok.hang_reported or not ok.entered:
                continue
            missing = [r for r in granks if r not in ok.entered]
            if not missing:
                continue
            since = min(m.t_enter for m in ok.entered.values())
            if not final and now - since < self.hang_timeout:
                continue
            ok.hang_reported = True
            if mark is not None:
                mark()
            found.append(self._missing(run, group_label(gname, granks), seq, ok, missing,
                                       now, since))
        self.stats.findings += len(found)
        return found

    def _missing(self, run: str, label: str, seq: int, ok: OpenKey, missing: list[int],
                 now: float, since: float) -> Finding:
        last = {}
        for r in missing:
            state = self.ranks.get(r)
            if state is None or state.last is None:
                last[str(r)] = None
                continue
            where, m = state.last
            last[str(r)] = {"op": m.op, "at": where, "callsite": m.callsite,
                            "ago_s": round(now - m.t_enter, 3) if math.isfinite(now) else None,
                            "said_goodbye": state.goodbye}
        waiting = sorted(ok.entered)
        any_meta = ok.entered[waiting[0]]
        return Finding(
            kind="missing_rank", run=run, op=any_meta.op, group=label, seq=seq,
            step=min(m.step for m in ok.entered.values()), culprits=missing,
            hosts=sorted({self.ranks[r].host for r in missing if r in self.ranks}),
            callsite=any_meta.callsite,
            detail={"waiting": waiting, "waited_s": round(now - since, 3)
                    if math.isfinite(now) else None, "last": last},
            t=since)

    def finish(self) -> list[Finding]:
        """End of the run: collectives still missing members are reported as hangs."""
        return self.check_hangs(math.inf, final=True)

    def unmatched(self) -> int:
        """Collectives some members never reported (dropped records or ranks that died)."""
        return len(self.open) + (self.fast.open_rows if self.fast is not None else 0)
