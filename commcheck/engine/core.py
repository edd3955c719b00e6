"""The engine: records in, findings out, matched across ranks by (run, group identity,
sequence).

:class:`Engine` keeps the rank states (from every batch's envelope) and the two paths
records take: clean traffic the vectorised fast path (``fastpath.py``) decides a block at a
time; whatever it cannot decide it hands (``handoff.py``) to the exact path (``exact.py``),
the only place that builds findings. ``Engine(fast=False)`` uses the exact path alone (the
reference the fast path is tested against). Stalls (dead ranks, missing ranks, hangs)
are decided by :meth:`Engine.check_hangs`, which the collector calls periodically with the
current time, over the open keys of both paths and what the relays saw of each rank's
process (:meth:`Engine.observe`; ``stalls.py``). Memory is bounded by the open window, not
by the run's length: each path evicts its oldest keys past its bound (see their modules).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import msgspec
import numpy as np

from ..wire import GOODBYE, HELLO, PHASE_ENTRY, RECORDS, Batch
from .block import RecordBlock
from .cells import COMPLETE
from .drops import Dropped
from .exact import ExactPath, Onset, OpenKeys
from .fastpath import DEFAULT_MAX_CELLS, DEFAULT_MAX_SPAN, FastPath
from .findings import Finding
from .handoff import Pending, Rows
from .lateness import Lateness
from .model import Key, Meta
from .stalls import Stalls
from .state import EngineStats, Liveness, RankCondition, RankState, condition
from .stragglers import StragglerRules, Stragglers

DEFAULT_HANG_TIMEOUT = 30.0
# The exact path's budget is this share of the fast path's cells: an exact cell (a member's
# Meta + Obs as Python objects) costs up to ~1 KiB against ~230 B for a fast one. The
# default, 2**17 cells, is 65,536 open pairwise keys (~110 MiB measured, a silent peer).
EXACT_CELLS_SHARE = 16


class Engine:
    """Batches (:meth:`ingest_many`) and the clock (:meth:`check_hangs`, :meth:`finish`)
    in, findings out; keeps each rank's state (``ranks``) and the counters (``stats``)."""

    def __init__(self, world_size: int = 0, hang_timeout: float = DEFAULT_HANG_TIMEOUT,
                 fast: bool = True, max_open_cells: int = DEFAULT_MAX_CELLS,
                 max_span: int = DEFAULT_MAX_SPAN, max_exact_cells: int | None = None,
                 stragglers: StragglerRules | None = None):
        """``max_open_cells`` and ``max_span`` bound the fast path (see fastpath.py);
        ``max_span`` (rounded up to a power of two, as there) and ``max_exact_cells``
        (default ``max_open_cells // EXACT_CELLS_SHARE``) bound the exact path.
        ``stragglers``: when a rank is named a straggler (stragglers.py); arrivals are
        timed on the fast path's blocks only (the exact-only engine is a reference for
        the consistency checks)."""
        self.world_size = world_size
        self.hang_timeout = hang_timeout
        # Every (run, rank) its own state: several runs analysed together, or a rank's
        # elastic restarts (``#restartN``), never mix counters or last calls.
        self.states: dict[tuple[str, int], RankState] = {}
        self.ranks: dict[int, RankState] = {}  # each rank's state in the run it last used
        self.max_span = 1 << max(3, (max_span - 1).bit_length())
        self.max_exact_cells = (max_open_cells // EXACT_CELLS_SHARE if max_exact_cells is None
                                else max_exact_cells)
        self.stats = EngineStats(world=world_size)
        self.runs: set[str] = set()
        self.exact = ExactPath(self.stats, self.max_span, self.max_exact_cells)
        self.fast = FastPath(self.exact, self.stats, max_open_cells, max_span) if fast else None
        self._ticket = 1
        self._books = _RankBooks(self.states)
        self.stalls = Stalls()
        self.dropped = Dropped()  # what ranks said they dropped (stalls.py asks it)
        self.lateness = Lateness()
        self.stragglers = Stragglers(stragglers)
        self._late: list[Finding] = []

    def __setstate__(self, d: dict) -> None:
        """An engine pickled before states were kept per (run, rank) keys them now; one
        pickled before arrivals were timed starts timing them."""
        self.__dict__.update(d)
        if "lateness" not in d:
            self.lateness, self.stragglers, self._late = Lateness(), Stragglers(), []
        if "states" not in d:
            self.states = {(s.run, r): s for r, s in self.ranks.items()}
            self._books = _RankBooks(self.states)

    @property
    def open(self) -> OpenKeys:
        """The exact path's open keys."""
        return self.exact.open

    @property
    def onsets(self) -> dict[tuple, Onset]:
        """First findings of kinds that stay true (``findings.FOLDED``), with how often they
        recurred: by (kind, run, group name or probe scope, group ranks), and for
        missing_rank also the missing ranks."""
        return self.exact.onsets

    @property
    def deaths(self) -> dict[tuple[str, int], Finding]:
        """The rank_died findings reported, by (run, rank). Their
        ``collectives_left_waiting`` goes on counting after they were reported; they are
        not in :attr:`onsets`, whose stored findings a collector finds by (kind, run,
        group, seq), which two ranks dying in one collective share."""
        return self.stalls.deaths

    def observe(self, rank: int, liveness: Liveness, now: float) -> None:
        """What ``rank``'s node relay sees of its process (about every second). A liveness
        without ``seen_t`` is taken as seen at ``now``. A rank gone without a goodbye is
        reported (``rank_died``) at the next :meth:`check_hangs`."""
        if not liveness.seen_t:
            liveness = msgspec.structs.replace(liveness, seen_t=now)
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankState(liveness.host)
            if len(self.runs) == 1:  # heard of by its relay only: the one run there is
                state.run = next(iter(self.runs))
        state.liveness = liveness
        self.stalls.observe(state.run, rank, state, now)

    def observe_many(self, seen: Mapping[int, Liveness] | Iterable[tuple[int, Liveness]],
                     now: float) -> None:
        """:meth:`observe` for each (rank, liveness)."""
        for rank, liveness in (seen.items() if isinstance(seen, Mapping) else seen):
            self.observe(rank, liveness, now)

    def state(self, run: str, rank: int) -> RankState | None:
        """``rank``'s state in ``run``; a rank heard of by its relay only (no records yet)
        counts as in any run."""
        state = self.states.get((run, rank))
        if state is None:
            state = self.ranks.get(rank)
            if state is not None and state.run not in ("", run):
                return None
        return state

    def condition(self, rank: int, now: float, run: str | None = None) -> RankCondition:
        """What ``rank`` is doing at ``now`` (``state.condition``), with its last entered
        call, since when it is blocked in it, and how long it has written nothing; in
        ``run`` (default: the run it last reported under)."""
        state = (self.state(run, rank) if run is not None else None) or self.ranks[rank]
        last = state.last
        blocked = last is not None and not self.completed_by(rank, last.key)
        lv = state.liveness
        return RankCondition(condition(state, now, self.hang_timeout, blocked), last,
                             last.meta.t_enter if blocked else None,
                             round(lv.idle_at(now), 3) if lv is not None else None)

    def completed_by(self, rank: int, key: Key) -> bool:
        """Whether ``rank`` completed ``key``: its completion is in the open key, or the key
        is not open any more (it closed, or was evicted)."""
        open_key = self.exact.open.get(key)
        if open_key is not None:
            return rank in open_key.complete
        if self.fast is not None:
            cell = self.fast.cell_state(key, rank)
            if cell is not None:
                return bool(cell & COMPLETE)
        return True

    @property
    def done(self) -> bool:
        """Every expected rank said goodbye or died (its relay saw it gone): nothing more
        will come from any of them."""
        n = self.world_size or max((r + 1 for r in self.ranks), default=0)
        return n > 0 and sum(s.goodbye or s.gone for s in self.ranks.values()) >= n

    def ingest(self, batch: Batch) -> list[Finding]:
        return self.ingest_many([batch])

    def ingest_many(self, batches: list[Batch]) -> list[Finding]:
        """Ingest batches in order; the same result as ingesting them one by one, but the
        fast path decides their records as one block."""
        items = []
        for batch in batches:
            state = self._envelope(batch)
            if self._count(batch, state):
                items.append((batch, state))
        if not items:
            return []
        ticket0 = self._next_tickets(sum(len(batch.records) for batch, _ in items))
        if self.fast is not None:
            timed = self.stragglers.rules.enabled
            findings = self.fast.ingest(items, ticket0, self._time_arrivals if timed else None)
            if self._late:
                findings += self._late
                self._late = []
        else:
            findings = self._ingest_exactly(items, ticket0)
        self._bound()
        self.stats.open_keys = self.unmatched()
        self.stats.findings += len(findings)
        return findings

    def _time_arrivals(self, blk: RecordBlock) -> None:
        """Who arrived last at the collectives the block finishes (lateness.py), and the
        stragglers that names (stragglers.py)."""
        done = self.lateness.feed(blk, blk.ids)
        if len(done):
            self._late += self.stragglers.add(done, blk.ids, self.lateness.host)

    def _envelope(self, batch: Batch) -> RankState:
        env = batch.env
        state = self.states.get((env.run, env.rank))
        if state is None:
            state = self.ranks.get(env.rank)
            if state is None or state.run not in ("", env.run):  # a new run (or restart)
                state = RankState(env.host, env.node)
            self.states[(env.run, env.rank)] = state
        self.ranks[env.rank] = state
        state.host, state.last_t = env.host, max(state.last_t, env.t)
        state.run = env.run
        if env.counters:
            state.counters.update(env.counters)
        if env.world > self.world_size:  # the ranks know their world better than an option
            self.world_size = self.stats.world = env.world
        self.runs.add(env.run)
        if env.drops:
            self.dropped.note(env.run, env.rank, env.drops)
        if env.failed:
            state.note_failed(env.run, env.failed)
        if env.kind == HELLO:
            state.hello = True
        elif env.kind == GOODBYE:
            state.goodbye = True
            if env.ending is not None:  # a plain tuple: the snapshot loads engine types only
                e = env.ending
                state.ending = (e.how, e.code, e.signal, e.error, e.thread)
        return state

    def _count(self, batch: Batch, state: RankState) -> bool:
        """Count a batch's records; whether it has any."""
        if batch.env.kind != RECORDS or not len(batch.records):
            return False
        state.records += len(batch.records)
        self.stats.records += len(batch.records)
        if self.fast is None:  # the fast path counts per op once per block
            recs = batch.records
            counts = np.bincount(recs["op"][recs["phase"] != PHASE_ENTRY])
            by_op = self.stats.recorded_by_op
            for op in np.flatnonzero(counts).tolist():
                name = batch.strings[op]
                by_op[name] = by_op.get(name, 0) + int(counts[op])
        return True

    def _next_tickets(self, n: int) -> int:
        """Reserve ``n`` arrival tickets (a global record order); returns the first."""
        t = self._ticket
        self._ticket += n
        return t

    def _ingest_exactly(self, items: list[tuple[Batch, RankState]], ticket: int
                        ) -> list[Finding]:
        findings: list[Finding] = []
        for batch, _ in items:
            rows = Rows(batch)
            for i in range(len(batch.records)):
                self.exact.record(rows, i, ticket, -1, self._books, findings)
                ticket += 1
        return findings

    def _bound(self) -> None:
        """Both paths within their bounds: the exact path evicts, and the fast path frees
        the ring slots of the keys it evicted."""
        evicted = self.exact.bound()
        if self.fast is not None:
            for wid, seq in evicted:
                self.fast.forget(wid, seq)

    def check_hangs(self, now: float, final: bool = False) -> list[Finding]:
        """``rank_died`` for ranks seen gone without a goodbye since the last check;
        ``missing_rank`` for collectives some members entered ``hang_timeout`` s ago while
        others never did; ``hang`` for those every member entered and not all completed,
        the last entry ``hang_timeout`` s ago. At the end of a run (``final``) regardless
        of time. Each once per cause (see stalls.py)."""
        found = self.stalls.check(self, now, final)
        self.stats.findings += len(found)
        return found

    def pending(self, now: float, final: bool) -> list[Pending]:
        """Open keys of both paths not reported yet, in the order they opened (the fast
        path's only once their first entry is ``hang_timeout`` s old, unless ``final``)."""
        cands = [Pending.of(key, open_key) for key, open_key in self.open.items()
                 if not open_key.hang_reported]
        if self.fast is not None:
            cands += self.fast.hang_candidates(now, final, self.hang_timeout)
            cands.sort(key=lambda p: p.born)
        return cands

    def involving(self, rank: int, run: str) -> list[Pending]:
        """Open keys of ``run``'s groups that ``rank`` did not complete and another member
        entered, in the order they opened, reported or not."""
        cands = [Pending.of(key, open_key) for key, open_key in self.open.items()
                 if key[0] == run and rank in key[2] and rank not in open_key.complete
                 and any(r != rank for r in open_key.entered)]
        if self.fast is not None:
            cands += self.fast.involving(rank, run)
            cands.sort(key=lambda p: p.born)
        return cands

    def finish(self) -> list[Finding]:
        """End of the run: collectives still open are reported (missing ranks, hangs)."""
        return self.check_hangs(math.inf, final=True)

    def unmatched(self) -> int:
        """Collectives some members never reported (dropped records or ranks that died)."""
        return len(self.open) + (self.fast.open_rows if self.fast is not None else 0)


class _RankBooks:
    """Each (run, rank)'s last entered and completed call, as the exact-only engine keeps
    them (the exact path's ``Books``; the fast path settles them per block instead)."""

    def __init__(self, states: dict[tuple[str, int], RankState]):
        self.states = states

    def entered(self, rank: int, key: Key, meta: Meta, ticket: int) -> None:
        self.states[(key[0], rank)].entered(key, meta)

    def completed(self, rank: int, key: Key, meta: Meta, t_done: float, ticket: int) -> None:
        self.states[(key[0], rank)].completed(key, meta, t_done)
