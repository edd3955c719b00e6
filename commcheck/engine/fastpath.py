"""The engine's vectorised path: clean traffic never becomes per-record Python objects.

A *block* (one or more batches, in arrival order) is placed with numpy: batch-local string
and group indices become engine-global ids, each record's fixed fields go to the cell
(row of its key, member index of its rank) of a size-class :class:`~.cells.Table`, rows
that become fully entered are checked for desync and rows that become fully complete are
decided, all as whole-array comparisons.

Anything the vectorised checks do not cover takes the exact path (``exact.py``: Meta/Obs,
:func:`desync`, :class:`Verdicts`, onsets), which stays the only place that says what a
finding is. The fast path reaches it through :class:`~.handoff.Handoff` only:

* records that are unusual on their own — chunks (pairwise ops), split sizes, more than
  ``SHAPE_DIMS`` dims, NaN/Inf counts or non-finite summaries, an unknown phase, a
  duplicate, an entry record that disagrees with its completion — send their whole key
  to the exact path (an existing row is converted to an OpenKey and taken over first);
* rows whose members disagree (desync signature, output hashes, mixed hash algorithms),
  whose checksum is not clearly within tolerance, or whose op needs chunk owners or a
  root (reduce, reduce_scatter) are converted and decided exactly, at the position in the
  block where the sequential engine would have decided them, so findings, onsets and
  their order are those of the exact path.

:class:`FastPath` orchestrates: placement, the block's replay on the exact path, and
eviction. Its parts live beside it: the vectorised rules in ``fast_verdicts.py``, the
blocks' chunk and split tables that open cells point into in ``kept.py``, rows read back as
Metas and Obs in ``fast_convert.py``, and the stall checks' queries in ``fast_stalls.py``.

Memory is bounded by the open window: each window's ring spans at most ``max_span``
sequence numbers and all tables hold at most ``max_cells`` cells; beyond that the oldest
rows are evicted and counted (``EngineStats.evicted``), and records that arrive later for
an evicted key are dropped and counted (``EngineStats.late``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..wire import PHASE_ENTRY, Batch
from .block import RecordBlock
from .cells import COMPLETE, EMPTY, ENTERED, EXACT, META_ITEM, META_WORDS, OBS_ITEM, Rings, Table
from .fast_convert import RowReader
from .fast_stalls import FastStalls
from .fast_verdicts import _EPS, FastVerdicts, _tolerance  # noqa: F401 (the tests' names)
from .handoff import HUGE_SEQ, Handoff, OpenKey, Pending
from .ids import Ids
from .kept import Kept
from .last import LastEntries
from .model import Finding, Key, Meta
from .state import EngineStats, RankState

DEFAULT_MAX_CELLS = 1 << 21  # about 450 MiB of open cells
DEFAULT_MAX_SPAN = 1 << 14  # sequence numbers one window may keep open
_BELOW = -3  # lookup result: under the window's base (closed, evicted or never fast)

# What the exact path must do with a row, at a record of the block: check the desync of a
# row whose signatures differ, close such a row once complete, decide a row that failed a
# vectorised verdict.
Event = tuple[int, int, int, int]  # record (block index), kind, table id, row
_DESYNC, _CLOSE, _DECIDE = 0, 1, 2


class Placement:
    """Where one block's records went: the fast path's state while it ingests the block."""

    def __init__(self, blk: RecordBlock):
        self.exact = blk.unusual | blk.all_exact  # records the exact path takes
        self.late = np.zeros(blk.n, bool)  # records for evicted keys: dropped
        # Per record: its key's ring value (a row once placed, or EMPTY / EXACT / _BELOW)
        # and the flat position of its ring slot.
        self.row = np.zeros(0, np.int64)
        self.slot = np.zeros(0, np.int64)
        self.events: list[Event] = []
        self.last = LastEntries(blk)
        self.kept_ids: dict[str, int] = {}  # ids the block's chunks and splits are kept under
        self.touched: set[int] = set()  # windows whose rings may slide after the block
        self.verified = 0  # rows decided clean


class FastPath:
    """Open keys as rows of size-class tables, found through per-window rings; a block at a
    time, whatever it cannot decide handed to the exact path (``exact``)."""

    def __init__(self, exact: Handoff, stats: EngineStats, max_cells: int = DEFAULT_MAX_CELLS,
                 max_span: int = DEFAULT_MAX_SPAN):
        """``exact``: where what this path cannot decide goes; ``stats``: the engine's
        counters, which this path adds to; ``max_cells`` and ``max_span`` bound it."""
        self.exact = exact
        self.stats = stats
        self.ids = Ids()
        self.tables: list[Table] = []
        self.rings = Rings()
        self.table_of = np.zeros(0, np.int64)  # window id -> table id
        self.max_cells = max_cells
        self.max_span = 1 << max(3, (max_span - 1).bit_length())
        self._slot_marks = np.zeros(0, np.int8)  # scratch of _same_key
        self.held = Kept()  # the blocks' chunk and split tables open cells point into
        self._parts()

    def _parts(self) -> None:
        self.verdicts = FastVerdicts(self.ids, self.held)
        self.reader = RowReader(self.ids, self.tables, self.held)
        self.stalls = FastStalls(self.ids, self.tables, self.reader)

    def __setstate__(self, d: dict) -> None:
        """A fast path pickled before its parts had modules of their own (the kept tables
        were its own dicts) gets them as parts."""
        if "held" not in d:
            d["held"] = Kept.restore(d.pop("kept"), d.pop("kept_refs"), d.pop("_kept_id"))
        self.__dict__.update(d)
        if "stalls" not in d:
            self._parts()

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def kept(self) -> dict[int, np.ndarray]:
        """The kept chunk and split tables, by id (``kept.py``)."""
        return self.held.tables

    @property
    def kept_refs(self) -> dict[int, int]:
        return self.held.refs

    @property
    def open_rows(self) -> int:
        return sum(t.rows_open for t in self.tables)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables) + self.rings.flat.nbytes

    def _add_windows(self, wids: list[int]) -> None:
        if not wids:
            return
        self.rings.add(len(wids))
        tids = [self.ids.windows[w].cls for w in wids]
        self.table_of = np.concatenate([self.table_of, np.array(tids, np.int64)])
        while len(self.tables) < len(self.ids.sizes):
            self.tables.append(Table(self.ids.sizes[len(self.tables)]))

    def _slot_of(self, wid: int, seq: int) -> int:
        """Flat ring position of (window, seq), or -1 when the ring does not cover it."""
        rings = self.rings
        if wid < 0 or not rings.base[wid] <= seq < rings.base[wid] + rings.size[wid]:
            return -1
        return int(rings.off[wid] + (seq & (rings.size[wid] - 1)))

    def forget(self, wid: int, seq: int) -> None:
        """The exact path evicted (window, seq): free the ring slot its key held and raise
        the window's floor, as this path's own eviction does, so that a later record is
        late instead of a new row. (The ring slides past the slot when a block next
        touches the window.)"""
        slot = self._slot_of(wid, seq)
        if slot < 0:
            return
        if self.rings.flat[slot] == EXACT:
            self.rings.flat[slot] = EMPTY
        self.rings.floor[wid] = max(int(self.rings.floor[wid]), seq + 1)

    # -- the block ---------------------------------------------------------------------------

    def ingest(self, items: list[tuple[Batch, RankState]], ticket0: int,
               watch: Callable[[RecordBlock], None] | None = None) -> list[Finding]:
        """Place a block (batches with their ranks' states; ``ticket0``: the arrival ticket
        of its first record) and decide what it completes; the findings, in order.
        ``watch`` reads the block's columns too (arrival times, lateness.py)."""
        blk = RecordBlock(self.ids, items, ticket0)
        if watch is not None:
            watch(blk)
        self._count_ops(blk)
        self._add_windows(blk.new_windows)
        place = Placement(blk)
        if blk.all_exact:  # exact keys must still own their ring slots
            self._cover(blk)
        else:
            candidates = self._lookup(blk, place)
            tids = self.table_of[blk.wid[candidates]]
            for tid in np.unique(tids).tolist():
                self._place(blk, place, tid, candidates[tids == tid])
        self.stats.late += int(place.late.sum())
        findings = self._replay(blk, place)
        if not blk.all_exact:
            place.last.settle()
        self.stats.verified += place.verified
        self._evict_cells(place)
        for w in place.touched:
            self.rings.slide(w)
        return findings

    def _lookup(self, blk: RecordBlock, place: Placement) -> np.ndarray:
        """Each record's ring slot and value (``place``); new keys get rows. Returns the
        records to place (the fast candidates)."""
        slot, row, in_ring = self._ring_values(blk)
        late = self._late(blk, row)
        exact = self._exact_keys(blk, slot, row, in_ring, late)
        candidates = ~exact & ~late & in_ring & ((row == EMPTY) | (row >= 0))
        self._open_rows(blk, slot, row, np.flatnonzero(candidates & (row == EMPTY)))
        place.exact, place.late, place.row, place.slot = exact, late, row, slot
        return np.flatnonzero(candidates)

    def _ring_values(self, blk: RecordBlock) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per record: the flat position of its key's ring slot, the value there (_BELOW
        under the ring's base) and whether the ring covers it."""
        rings = self._cover(blk)
        wid, seq = blk.wid, blk.seq
        in_ring = (seq >= rings.base[wid]) & ~blk.huge
        slot = rings.off[wid] + (seq & (rings.size[wid] - 1))
        row = np.where(in_ring, rings.flat[np.where(in_ring, slot, 0)], _BELOW)
        return slot, row, in_ring

    def _late(self, blk: RecordBlock, row: np.ndarray) -> np.ndarray:
        """Records under their window's floor for keys no path holds open (evicted)."""
        under = blk.seq < self.rings.floor[blk.wid]
        late = (row == EMPTY) & under
        below = row == _BELOW
        if below.any():  # closed, evicted or exact-path keys under the base
            for j in np.flatnonzero(below & under).tolist():
                late[j] = not self.exact.is_open(blk.key(j))
        return late

    def _exact_keys(self, blk: RecordBlock, slot: np.ndarray, row: np.ndarray,
                    in_ring: np.ndarray, late: np.ndarray) -> np.ndarray:
        """Records the exact path takes: unusual ones, those of keys it holds or that are
        under the ring's base, and every record of a key with an unusual one (a key goes to
        the exact path whole)."""
        exact = blk.unusual | (row == _BELOW) | (row == EXACT)
        exact &= ~late
        placeable = in_ring & ~late & ((row == EMPTY) | (row >= 0))
        unusual_slots = slot[placeable & blk.unusual]
        if len(unusual_slots):
            exact |= self._same_key(unusual_slots, slot, in_ring) & placeable
        return exact

    def _open_rows(self, blk: RecordBlock, slot: np.ndarray, row: np.ndarray,
                   new: np.ndarray) -> None:
        """A row for each new key (records ``new``), written into ``row`` and the ring."""
        if not len(new):
            return
        rings = self.rings
        slots = slot[new]
        rings.flat[slots] = -(new + 10)  # one record per key: the last writer of a marker wins
        openers = new[rings.flat[slots] == -(new + 10)]
        tids = self.table_of[blk.wid[openers]]
        for tid in np.unique(tids).tolist():
            recs = openers[tids == tid]
            table = self.tables[tid]
            rows = table.alloc(len(recs))
            rings.flat[slot[recs]] = rows
            table.wid[rows], table.seq[rows] = blk.wid[recs], blk.seq[recs]
            table.born[rows] = np.iinfo(np.int64).max
        row[new] = rings.flat[slots]
        tids = self.table_of[blk.wid[new]]
        for tid in np.unique(tids).tolist():  # born: the key's first record in the block
            recs = new[tids == tid]
            np.minimum.at(self.tables[tid].born, row[recs], blk.ticket[recs])

    def _cover(self, blk: RecordBlock) -> Rings:
        """Grow (or, past ``max_span``, slide and evict) rings to cover the block's seqs."""
        rings = self.rings
        ringed = ~blk.huge
        highest = np.full(len(rings.off), -1, np.int64)
        np.maximum.at(highest, blk.wid[ringed], blk.seq[ringed])
        seen = np.flatnonzero(highest >= 0)
        rings.top[seen] = np.maximum(rings.top[seen], highest[seen] + 1)
        for w in seen[highest[seen] >= rings.base[seen] + rings.size[seen]].tolist():
            need = int(highest[w] - rings.base[w] + 1)
            if need > self.max_span:
                self._evict_below(w, int(highest[w]) - self.max_span + 1)
                need = int(highest[w] - rings.base[w] + 1)
            if need > rings.size[w]:
                rings.resize(w, 1 << (need - 1).bit_length())
        if len(self._slot_marks) < len(rings.flat):
            self._slot_marks = np.zeros(len(rings.flat), np.int8)
        return rings

    def _same_key(self, some: np.ndarray, slot: np.ndarray, in_ring: np.ndarray) -> np.ndarray:
        """Records (``slot``: their ring slots) whose key is one of the ``some`` slots'."""
        mark = self._slot_marks
        mark[some] = 1
        out = in_ring & (mark[np.where(in_ring, slot, 0)] == 1)
        mark[some] = 0
        return out

    # -- placement and vectorised decisions ---------------------------------------------------

    def _place(self, blk: RecordBlock, place: Placement, tid: int, recs: np.ndarray) -> None:
        """Write the candidates ``recs`` (of table ``tid``) into their cells, then check the
        rows every member has now entered and decide those every member completed."""
        table = self.tables[tid]
        # Cells by flat index into raveled views: 2-4x faster than (row, member) pairs.
        cells = place.row[recs] * table.n + blk.member[recs]
        entering, completing = self._screen(blk, place, table, recs, cells)
        entered, entered_at = self._enter(blk, place, table, recs[entering], cells[entering])
        completed, completed_at = self._complete(blk, place, table, recs[completing],
                                                 cells[completing])
        desynced = self._check_signatures(place, tid, table, entered, entered_at)
        self._decide(place, tid, table, completed, completed_at, desynced)

    def _screen(self, blk: RecordBlock, place: Placement, table: Table, recs: np.ndarray,
                cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which records enter their cell and which complete it (masks over ``recs``). A
        record that does not fit its cell sends its key to the exact path, whole."""
        is_entry = blk.phase[recs] == PHASE_ENTRY
        misfit = np.zeros(len(recs), bool)
        entries, completions = np.flatnonzero(is_entry), np.flatnonzero(~is_entry)
        misfit[entries] = self._misfit_entries(blk, table, recs[entries], cells[entries])
        misfit[completions], unentered = self._misfit_completions(
            blk, table, recs[completions], cells[completions])
        if misfit.any():
            misfit = self._same_key(place.slot[recs[misfit]], place.slot[recs],
                                    np.ones(len(recs), bool))
            self._drop_fresh(blk, place, table, place.row[recs[misfit]])
            place.exact[recs[misfit]] = True
        entering = is_entry.copy()
        entering[completions[unentered]] = True  # a completion enters a cell nothing entered
        return entering & ~misfit, ~is_entry & ~misfit

    @staticmethod
    def _misfit_entries(blk: RecordBlock, table: Table, recs: np.ndarray,
                        cells: np.ndarray) -> np.ndarray:
        """Entries into a cell entered already, or with another entry in the block."""
        marks, tickets = table.mark.reshape(-1), blk.ticket[recs]
        marks[cells] = tickets
        return ((table.state.reshape(-1)[cells] & ENTERED) != 0) | (marks[cells] != tickets)

    @staticmethod
    def _misfit_completions(blk: RecordBlock, table: Table, recs: np.ndarray,
                            cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Completions of a cell completed already or with another completion in the block,
        before their entry in the block, or unlike their cell's entry (its metadata); and
        those of cells nothing entered (they enter them). Runs after _misfit_entries, whose
        marks name the block's entry of each cell."""
        marks, tickets = table.mark.reshape(-1), blk.ticket[recs]
        state = table.state.reshape(-1)[cells]
        entry_ticket = marks[cells]
        has_entry = entry_ticket >= blk.ticket0  # an entry for the cell in this block
        entry = np.where(has_entry, entry_ticket - blk.ticket0, recs)
        entered_before = (state & ENTERED) != 0
        misfit = ((state & COMPLETE) != 0) | (has_entry & (entry > recs))
        ref = blk.meta_items[entry]
        earlier = entered_before & ~has_entry
        if earlier.any():
            ref[earlier] = table.meta_w.view(META_ITEM).reshape(-1)[cells[earlier]]
        mine = blk.meta_items[recs].view(np.uint64).reshape(-1, META_WORDS)
        misfit |= (has_entry | entered_before) & (
            mine != ref.view(np.uint64).reshape(-1, META_WORDS)).any(axis=1)
        marks[cells] = tickets
        misfit |= marks[cells] != tickets
        return misfit, ~has_entry & ~entered_before

    def _enter(self, blk: RecordBlock, place: Placement, table: Table, recs: np.ndarray,
               cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entering records write their metadata into their cells. Returns the rows every
        member has now entered, with the record that made each full."""
        table.meta_w.view(META_ITEM).reshape(-1)[cells] = blk.meta_items[recs]
        table.ent_at.reshape(-1)[cells] = blk.ticket[recs]
        table.state.reshape(-1)[cells] |= ENTERED
        if blk.split_at is not None:  # the Metas of a converted row must carry them
            self.held.point(place.kept_ids, "splits", blk.splits, blk.split_at[recs], cells,
                            table.sblk, table.soff)
        rows = place.row[recs]
        np.minimum.at(table.min_t, rows, blk.t_enter[recs])
        place.last.entered_fast(recs)
        return self._count(table, table.n_ent, rows, recs)

    def _complete(self, blk: RecordBlock, place: Placement, table: Table, recs: np.ndarray,
                  cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Completing records write what they report into their cells. Returns the rows
        every member has now completed, with the record that made each full."""
        table.obs_b.view(OBS_ITEM).reshape(-1)[cells] = blk.obs_items[recs]
        table.algo.reshape(-1)[cells] = blk.algo[recs]
        table.flags.reshape(-1)[cells] = blk.flags[recs]
        table.cmp_at.reshape(-1)[cells] = blk.ticket[recs]
        if blk.chunk_at is not None:
            self._keep_chunks(blk, place, table, recs, cells)
        table.state.reshape(-1)[cells] |= COMPLETE
        place.last.completed_fast(recs)
        return self._count(table, table.n_cmp, place.row[recs], recs)

    def _check_signatures(self, place: Placement, tid: int, table: Table, rows: np.ndarray,
                          at: np.ndarray) -> np.ndarray:
        """Rows every member entered: do their desync signatures agree? Returns those that
        do not; the exact path checks them at the record that made them full."""
        if not len(rows):
            return rows
        differ = self.verdicts.signatures_differ(table, rows)
        _schedule(place, _DESYNC, tid, at[differ], rows[differ])
        return rows[differ]

    def _count_ops(self, blk: RecordBlock) -> None:
        """Completion records per op name (``EngineStats.recorded_by_op``), once per block."""
        counts = np.bincount(blk.op[blk.phase != PHASE_ENTRY])
        by_op, strings = self.stats.recorded_by_op, self.ids.strings
        for op in np.flatnonzero(counts).tolist():
            by_op[strings[op]] = by_op.get(strings[op], 0) + int(counts[op])

    def _decide(self, place: Placement, tid: int, table: Table, rows: np.ndarray,
                at: np.ndarray, desynced: np.ndarray) -> None:
        """Rows every member completed: those whose signatures differ close on the exact
        path; the others are decided, clean ones here, the rest on the exact path (each at
        the record that made it full)."""
        if not len(rows):
            return
        closing = np.isin(rows, desynced)
        _schedule(place, _CLOSE, tid, at[closing], rows[closing])
        rows, at = rows[~closing], at[~closing]
        clean = self.verdicts.verdict(table, rows)
        _schedule(place, _DECIDE, tid, at[~clean], rows[~clean])
        place.verified += int(clean.sum())
        if clean.any():
            counts = np.bincount(table.meta["op"][rows[clean], 0])
            for op in np.flatnonzero(counts).tolist():
                self.stats.verified_op(self.ids.strings[op], int(counts[op]))
        self._close(place, table, rows[clean])

    def _keep_chunks(self, blk: RecordBlock, place: Placement, table: Table,
                     recs: np.ndarray, cells: np.ndarray) -> None:
        at = blk.chunk_at[recs]
        has = self.held.point(place.kept_ids, "chunks", blk.chunks, at, cells, table.cblk,
                              table.coff)
        scatter = has & blk.scatter[recs]
        if scatter.any():  # each member's chunk sums, added up per destination (column)
            sums = blk.chunks["sum"][at[scatter][:, None] + np.arange(table.n)]
            rows = cells[scatter] // table.n
            np.add.at(table.exp, rows, sums)
            np.add.at(table.exp_abs, rows, np.abs(sums))

    def _release(self, table: Table, rows: np.ndarray) -> None:
        """Free rows, and the kept tables no open cell points into any more."""
        self.held.release(table, rows)
        table.release(rows)

    @staticmethod
    def _count(table: Table, counter: np.ndarray, rows: np.ndarray,
               recs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add one per record to its row's counter; rows that reached ``n`` and the block
        index of the record that completed each."""
        if not len(rows):
            return rows, rows
        k = np.bincount(rows, minlength=table.cap)
        hit = np.flatnonzero(k)
        counter[hit] += k[hit]
        full = hit[counter[hit] == table.n]
        if not len(full):
            return full, full
        last = np.full(table.cap, -1, np.int64)
        np.maximum.at(last, rows, recs)
        return full, last[full]

    def _close(self, place: Placement, table: Table, rows: np.ndarray) -> None:
        """Rows decided clean: free them and their ring slots."""
        if not len(rows):
            return
        wids, seqs = table.wid[rows], table.seq[rows]
        rings = self.rings
        rings.flat[rings.off[wids] + (seqs & (rings.size[wids] - 1))] = EMPTY
        place.touched.update(np.unique(wids).tolist())
        self._release(table, rows)

    def _drop_fresh(self, blk: RecordBlock, place: Placement, table: Table,
                    rows: np.ndarray) -> None:
        """Rows opened in this block for keys that turned out to need the exact path."""
        fresh = np.unique(rows[table.born[rows] >= blk.ticket0])
        if len(fresh):
            self._close(place, table, fresh)

    # -- exact path, in block order -------------------------------------------------------------

    def _replay(self, blk: RecordBlock, place: Placement) -> list[Finding]:
        """Hand the exact path its records and events in block order, so that it meets each
        where the sequential engine would have."""
        findings: list[Finding] = []
        exact, events = np.flatnonzero(place.exact), place.events
        if not len(exact) and not events:
            return findings
        events.sort()
        next_event, n_events = 0, len(events)
        for j in [*exact.tolist(), blk.n]:
            while next_event < n_events and events[next_event][0] < j:
                self._event(place, events[next_event], findings)
                next_event += 1
            if j < blk.n:
                self._record(blk, place, j, findings)
        return findings

    def _record(self, blk: RecordBlock, place: Placement, j: int,
                findings: list[Finding]) -> None:
        """Record ``j`` on the exact path (its key's open row, if any, handed over first);
        the key's ring slot stays EXACT while the exact path holds it."""
        wid, seq = int(blk.wid[j]), int(blk.seq[j])
        slot = -1 if blk.huge[j] else self._slot_of(wid, seq)
        if slot >= 0 and self.rings.flat[slot] >= 0:  # an open fast row: hand it over first
            key, open_key = self.convert(int(self.table_of[wid]), int(self.rings.flat[slot]))
            self.rings.flat[slot] = EXACT
            self.exact.take_over(key, open_key, findings)
        rows, i = blk.rows(j)
        closed = self.exact.record(rows, i, int(blk.ticket[j]), wid, place.last, findings)
        if slot < 0:
            return
        if self.exact.is_open(blk.key(j)):
            self.rings.flat[slot] = EXACT
        elif closed:
            self.rings.flat[slot] = EMPTY
            place.touched.add(wid)

    def _event(self, place: Placement, event: Event, findings: list[Finding]) -> None:
        """Hand the exact path a row of the block that failed a vectorised check: convert
        it and check its desync (_DESYNC), close it once complete (_CLOSE), or decide it
        (_DECIDE)."""
        _, kind, tid, row = event
        table = self.tables[tid]
        wid, seq = int(table.wid[row]), int(table.seq[row])
        if kind == _CLOSE:
            self._close_taken_over(place, wid, seq, findings)
            return
        slot = self._slot_of(wid, seq)
        key, open_key = self.convert(tid, row, kind != _DESYNC)
        if kind == _DESYNC:
            self.rings.flat[slot] = EXACT
            self.exact.take_over(key, open_key, findings)
            # A _CLOSE event for this key may follow: it finds the key through the freed
            # row's wid/seq, which nothing reallocates while events run.
        else:
            self.rings.flat[slot] = EMPTY
            place.touched.add(wid)
            findings.extend(self.exact.decide(key, open_key.complete))

    def _close_taken_over(self, place: Placement, wid: int, seq: int,
                          findings: list[Finding]) -> None:
        """A row converted at its _DESYNC event (the row is gone, its key is open on the
        exact path) became complete: close the key there, and free its ring slot."""
        win = self.ids.windows[wid]
        if self.exact.close_if_complete((win.run, win.name, win.ranks, seq), findings):
            slot = self._slot_of(wid, seq)
            if slot >= 0 and self.rings.flat[slot] == EXACT:
                self.rings.flat[slot] = EMPTY
                place.touched.add(wid)

    # -- rows as the exact path's objects -------------------------------------------------------

    def convert(self, tid: int, row: int, signatures_agree: bool = True
                ) -> tuple[Key, OpenKey]:
        """Hand a fast row over to the exact path as an OpenKey (the row is freed; the
        caller sets its ring slot). Its desync counts as checked once every member entered,
        unless their signatures differ."""
        table = self.tables[tid]
        wid, seq = int(table.wid[row]), int(table.seq[row])
        win = self.ids.windows[wid]
        entered = self.metas(tid, row)
        open_key = OpenKey(entered, self.reader.observations(table, row, entered),
                           desync_checked=signatures_agree and int(table.n_ent[row]) == table.n,
                           hang_reported=bool(table.hang[row]), born=int(table.born[row]),
                           wid=wid)
        self._release(table, np.array([row]))
        return (win.run, win.name, win.ranks, seq), open_key

    def metas(self, tid: int, row: int) -> dict[int, Meta]:
        """What each member that entered a row said, by rank, in the order they entered."""
        return self.reader.metas(tid, row)

    # -- stalls, eviction ---------------------------------------------------------------------

    def hang_candidates(self, now: float, final: bool, timeout: float) -> list[Pending]:
        """Open rows that wait too long (``FastStalls.hang_candidates``)."""
        return self.stalls.hang_candidates(now, final, timeout)

    def involving(self, rank: int, run: str) -> list[Pending]:
        """Open rows that wait for ``rank`` (``FastStalls.involving``)."""
        return self.stalls.involving(rank, run)


    def cell_state(self, key: Key, rank: int) -> int | None:
        """ENTERED/COMPLETE bits of ``rank``'s cell in the open row of ``key``; None when no
        fast row holds the key open."""
        wid = self.ids.window_of(key[:3])
        if wid is None or key[3] >= HUGE_SEQ:
            return None
        slot = self._slot_of(wid, key[3])
        if slot < 0 or self.rings.flat[slot] < 0:
            return None
        row = int(self.rings.flat[slot])
        table = self.tables[int(self.table_of[wid])]
        if not table.used[row] or int(table.wid[row]) != wid or int(table.seq[row]) != key[3]:
            return None
        return int(table.state[row, self.ids.windows[wid].col(rank)])

    def _evict_below(self, w: int, new_base: int) -> None:
        """Slide window ``w`` up to ``new_base``, dropping the fast rows under it."""
        rings = self.rings
        below = max(0, min(int(rings.size[w]), new_base - int(rings.base[w])))
        pos = rings.positions(w)[:below]
        vals = rings.flat[pos]
        rows = vals[vals >= 0]
        if len(rows):
            self._evict(self.tables[int(self.table_of[w])], rows)
        rings.flat[pos] = EMPTY  # exact-path keys under the base stay open there
        rings.base[w] = new_base
        rings.floor[w] = max(int(rings.floor[w]), new_base)

    def _evict(self, table: Table, rows: np.ndarray) -> None:
        rings = self.rings
        wids, seqs = table.wid[rows], table.seq[rows]
        rings.flat[rings.off[wids] + (seqs & (rings.size[wids] - 1))] = EMPTY
        np.maximum.at(rings.floor, wids, seqs + 1)
        self.stats.evicted += len(rows)
        self._release(table, rows)

    def _evict_cells(self, place: Placement) -> None:
        """Past ``max_cells``, drop the oldest rows (by the ticket that opened them)."""
        used = sum(t.rows_open * t.n for t in self.tables)
        if used <= self.max_cells:
            return
        cand = [(t.born[t.used], tid, np.flatnonzero(t.used))
                for tid, t in enumerate(self.tables)]
        born = np.concatenate([b for b, _, _ in cand])
        tids = np.concatenate([np.full(len(b), tid) for b, tid, _ in cand])
        rows = np.concatenate([used for _, _, used in cand])
        sizes = np.array(self.ids.sizes)[tids]
        order = np.argsort(born, kind="stable")
        freed = np.cumsum(sizes[order])
        k = int(np.searchsorted(freed, used - self.max_cells * 7 // 8)) + 1
        victims = order[:k]
        for tid in np.unique(tids[victims]).tolist():
            chosen = victims[tids[victims] == tid]
            self._evict(self.tables[tid], rows[chosen])
            place.touched.update(np.unique(self.tables[tid].wid[rows[chosen]]).tolist())


def _schedule(place: Placement, kind: int, tid: int, at: np.ndarray, rows: np.ndarray) -> None:
    """Events of ``kind`` for ``rows`` of table ``tid``, at records ``at``."""
    place.events.extend((a, kind, tid, r) for a, r in zip(at.tolist(), rows.tolist(),
                                                         strict=True))


