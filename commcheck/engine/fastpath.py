"""The engine's vectorised path: clean traffic never becomes per-record Python objects.

A *block* (one or more batches, in arrival order) is placed with numpy: batch-local string
and group indices become engine-global ids, each record's fixed fields go to the cell
(row of its key, member index of its rank) of a size-class :class:`~.cells.Table`, rows
that become fully entered are checked for desync and rows that become fully complete are
decided, all as whole-array comparisons.

Anything the vectorised checks do not cover takes the exact path in ``core.py``
(Meta/Obs, :func:`desync`, :class:`Verdicts`, onsets), which stays the only place that
says what a finding is:

* records that are unusual on their own — chunks (pairwise ops), split sizes, more than
  ``SHAPE_DIMS`` dims, NaN/Inf counts or non-finite summaries, an unknown phase, a
  duplicate, an entry record that disagrees with its completion — send their whole key
  to the exact path (an existing row is converted to an OpenKey first);
* rows whose members disagree (desync signature, output hashes, mixed hash algorithms),
  whose checksum is not clearly within tolerance, or whose op needs chunk owners or a
  root (reduce, reduce_scatter) are converted and decided exactly, at the position in the
  block where the sequential engine would have decided them, so findings, onsets and
  their order are those of the exact path.

Memory is bounded by the open window: each window's ring spans at most ``max_span``
sequence numbers and all tables hold at most ``max_cells`` cells; beyond that the oldest
rows are evicted and counted (``EngineStats.evicted``), and records that arrive later for
an evicted key are dropped and counted (``EngineStats.late``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ..wire import F_IN_HASH, F_IN_SUMMARY, F_OUT_HASH, F_OUT_SUMMARY, PHASE_ENTRY, Batch
from .block import Block, meta_list
from .cells import (
    COMPLETE,
    EMPTY,
    ENTERED,
    META_DTYPE,
    META_ITEM,
    META_WORDS,
    OBS_DTYPE,
    OBS_ITEM,
    SLOW,
    Rings,
    Table,
)
from .desync import desync
from .handoff import OpenKey
from .ids import RED_ALL, RED_NONE, RED_SCATTER, Ids
from .model import Finding, Key, Meta, Obs
from .state import RankState

if TYPE_CHECKING:
    from .core import Engine

_LOW64 = (1 << 64) - 1
DEFAULT_MAX_CELLS = 1 << 21  # about 450 MiB of open cells
DEFAULT_MAX_SPAN = 1 << 14  # sequence numbers one window may keep open
_BELOW = -3  # lookup result: under the window's base (closed, evicted or never fast)


def _sig_words() -> tuple[list[int], np.ndarray, np.ndarray]:
    """META words holding the desync signature, with the bit masks of what members must
    agree on: op, dtype, redop, root, numel_in, numel_out; for all_to_alls (uneven splits
    let the counts differ, see ops._UNEVEN) op, dtype, redop and root. Splits are not
    compared (they are not agreed on where they may be present)."""
    masks = []
    for fields in (("op", "dtype", "redop", "root", "numel_in", "numel_out"),
                   ("op", "dtype", "redop", "root")):
        mask = np.zeros(META_DTYPE.itemsize, np.uint8)
        for f in fields:
            dt, off = META_DTYPE.fields[f][:2]
            mask[off:off + dt.itemsize] = 0xFF
        masks.append(mask.view(np.uint64))
    keep = np.flatnonzero(masks[0])
    return keep.tolist(), masks[0][keep], masks[1][keep]


_SIG_WORDS, _SIG_MASK, _SIG_MASK_UNEVEN = _sig_words()
_EPS = 2.0**-52

Event = tuple[int, int, int, int]  # block index, kind, table, row
_DESYNC, _CLOSE, _DECIDE = 0, 1, 2


class FastPath:
    def __init__(self, engine: Engine, max_cells: int = DEFAULT_MAX_CELLS,
                 max_span: int = DEFAULT_MAX_SPAN):
        self.eng = engine
        self.ids = Ids()
        self.tables: list[Table] = []
        self.rings = Rings()
        self.wcls = np.zeros(0, np.int64)  # window -> table index
        self.max_cells = max_cells
        self.max_span = 1 << max(3, (max_span - 1).bit_length())
        self._badmark = np.zeros(0, np.int8)
        self._touched: set[int] = set()  # windows whose rings may slide after this block
        self._verified = 0
        # Blocks' chunk tables (Block._gathers) and split-size tables (Block._uneven) that
        # open cells still point into, by id, with how many cells point into each.
        self.kept: dict[int, np.ndarray] = {}
        self.kept_refs: dict[int, int] = {}
        self._kept_id = 0

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def open_rows(self) -> int:
        return sum(t.rows_open for t in self.tables)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables) + self.rings.flat.nbytes

    def _new_windows(self, wids: list[int]) -> None:
        self.rings.add(len(wids))
        cls = [self.ids.windows[w].cls for w in wids]
        self.wcls = np.concatenate([self.wcls, np.array(cls, np.int64)])
        while len(self.tables) < len(self.ids.sizes):
            self.tables.append(Table(self.ids.sizes[len(self.tables)]))

    def ring_pos(self, w: int, seq: int) -> int:
        """Flat ring position of (window, seq), or -1 when the ring does not cover it."""
        r = self.rings
        if w < 0 or not r.base[w] <= seq < r.base[w] + r.size[w]:
            return -1
        return int(r.off[w] + (seq & (r.size[w] - 1)))

    def opened(self, ok: OpenKey, seq: int) -> None:
        """The exact path opened a key: claim its ring slot so no fast row shadows it."""
        p = self.ring_pos(ok.wid, seq)
        if p >= 0:
            self.rings.flat[p] = SLOW

    def closed(self, ok: OpenKey, seq: int) -> None:
        p = self.ring_pos(ok.wid, seq)
        if p >= 0 and self.rings.flat[p] == SLOW:
            self.rings.flat[p] = EMPTY
            self._touched.add(ok.wid)

    # -- the block ---------------------------------------------------------------------------

    def ingest(self, items: list[tuple[Batch, RankState]]) -> list[Finding]:
        blk = Block(self, items)
        self._touched = set()
        self._verified = 0
        events: list[Event] = []
        slow = blk.slow
        if blk.all_slow:  # exact keys must still own their ring slots
            self._cover(blk)
        else:
            cand = self._lookup(blk)
            for c in np.unique(self.wcls[blk.wid[cand]]).tolist():
                self._place(blk, c, cand[self.wcls[blk.wid[cand]] == c], events)
            slow = blk.slow
        self.eng.stats.late += int(blk.late.sum())
        findings = self._run(blk, np.flatnonzero(slow), events)
        if not blk.all_slow:
            self._settle_last(blk)
        self.eng.stats.verified += self._verified
        self._evict_cells()
        for w in self._touched:
            self.rings.slide(w)
        return findings

    def _lookup(self, blk: Block) -> np.ndarray:
        """Ring values for every record; new keys get rows. Returns the fast candidates."""
        r = self._cover(blk)
        wid, seq = blk.wid, blk.seq
        size = r.size[wid]
        inr = (seq >= r.base[wid]) & ~blk.huge
        pos = r.off[wid] + (seq & (size - 1))
        val = np.where(inr, r.flat[np.where(inr, pos, 0)], _BELOW)
        floor = r.floor[wid]
        late = (val == EMPTY) & (seq < floor)
        below = val == _BELOW
        if below.any():  # closed, evicted or exact-path keys under the base
            for j in np.flatnonzero(below & (seq < floor)).tolist():
                late[j] = not blk.key_open(j)
        blk.late = late
        slow = blk.slow | below | (val == SLOW)
        slow &= ~late
        # A key with any unusual record goes to the exact path whole.
        bad_pos = pos[inr & blk.slow & ~late & ((val == EMPTY) | (val >= 0))]
        if len(bad_pos):
            keybad = self._same_key(bad_pos, pos, inr)
            slow |= keybad & ~late & ((val == EMPTY) | (val >= 0))
        cand_mask = ~slow & ~late & inr & ((val == EMPTY) | (val >= 0))
        # New keys: one row per distinct ring position (the last writer of a marker wins).
        jn = np.flatnonzero(cand_mask & (val == EMPTY))
        if len(jn):
            pn = pos[jn]
            r.flat[pn] = -(jn + 10)
            win = jn[r.flat[pn] == -(jn + 10)]
            wcls = self.wcls[wid[win]]
            for c in np.unique(wcls).tolist():
                jw = win[wcls == c]
                t = self.tables[c]
                rows = t.alloc(len(jw))
                r.flat[pos[jw]] = rows
                t.wid[rows], t.seq[rows] = wid[jw], seq[jw]
                t.born[rows] = np.iinfo(np.int64).max
            val[jn] = r.flat[pn]
            cls = self.wcls[wid[jn]]
            for c in np.unique(cls).tolist():
                m = cls == c
                np.minimum.at(self.tables[c].born, val[jn[m]], blk.ticket[jn[m]])
        blk.slow, blk.val, blk.pos = slow, val, pos
        return np.flatnonzero(cand_mask)

    def _cover(self, blk: Block) -> Rings:
        """Grow (or, past ``max_span``, slide and evict) rings to cover the block's seqs."""
        r = self.rings
        ok = ~blk.huge
        hi = np.full(len(r.off), -1, np.int64)
        np.maximum.at(hi, blk.wid[ok], blk.seq[ok])
        touched = np.flatnonzero(hi >= 0)
        r.top[touched] = np.maximum(r.top[touched], hi[touched] + 1)
        for w in touched[hi[touched] >= r.base[touched] + r.size[touched]].tolist():
            need = int(hi[w] - r.base[w] + 1)
            if need > self.max_span:
                self._evict_below(w, int(hi[w]) - self.max_span + 1)
                need = int(hi[w] - r.base[w] + 1)
            if need > r.size[w]:
                r.resize(w, 1 << (need - 1).bit_length())
        if len(self._badmark) < len(r.flat):
            self._badmark = np.zeros(len(r.flat), np.int8)
        return r

    def _same_key(self, bad_pos: np.ndarray, pos: np.ndarray, inr: np.ndarray) -> np.ndarray:
        mark = self._badmark
        mark[bad_pos] = 1
        out = inr & (mark[np.where(inr, pos, 0)] == 1)
        mark[bad_pos] = 0
        return out

    # -- placement and vectorised decisions ---------------------------------------------------

    def _place(self, blk: Block, c: int, j: np.ndarray, events: list[Event]) -> None:
        t = self.tables[c]
        slot, col = blk.val[j], blk.col[j]
        # Cells by flat index into raveled views: 2-4x faster than (row, col) index pairs.
        cell = slot * t.n + col
        mark, state = t.mark.reshape(-1), t.state.reshape(-1)
        tk = blk.ticket[j]
        st = state[cell]
        is_e = blk.phase[j] == PHASE_ENTRY
        bad = np.zeros(len(j), bool)
        # Entry records: at most one per cell, and only into a cell not yet entered.
        e = np.flatnonzero(is_e)
        ce = cell[e]
        mark[ce] = tk[e]
        bad[e] = ((st[e] & ENTERED) != 0) | (mark[ce] != tk[e])
        # Completion records: after the cell's entry (same metadata), at most one per cell.
        cc = np.flatnonzero(~is_e)
        cellc, jc = cell[cc], j[cc]
        em = mark[cellc]
        has_e = em >= blk.ticket0
        ej = np.where(has_e, em - blk.ticket0, jc)
        was_in = (st[cc] & ENTERED) != 0
        bad[cc] = ((st[cc] & COMPLETE) != 0) | (has_e & (ej > jc))
        items = blk.meta_items
        ref = items[ej]
        if was_in.any():
            ref[was_in & ~has_e] = t.meta_w.view(META_ITEM).reshape(-1)[cellc[was_in & ~has_e]]
        mine = items[jc].view(np.uint64).reshape(-1, META_WORDS)
        bad[cc] |= (has_e | was_in) & (mine != ref.view(np.uint64).reshape(-1, META_WORDS)
                                       ).any(axis=1)
        mark[cellc] = tk[cc]
        bad[cc] |= mark[cellc] != tk[cc]
        if bad.any():
            bad = self._same_key(blk.pos[j[bad]], blk.pos[j], np.ones(len(j), bool))
            self._drop_fresh(t, slot[bad], blk)
            blk.slow[j[bad]] = True
        good = ~bad
        enter = is_e.copy()
        enter[cc[~has_e & ~was_in]] = True
        enter &= good
        ent_j, ent_s, ent_cell = j[enter], slot[enter], cell[enter]
        t.meta_w.view(META_ITEM).reshape(-1)[ent_cell] = blk.meta_items[ent_j]
        t.ent_at.reshape(-1)[ent_cell] = blk.ticket[ent_j]
        state[ent_cell] |= ENTERED
        if blk.split_at is not None:  # the Metas of a converted row must carry them
            self._point(blk, "splits", blk.split_table, blk.split_at[ent_j], ent_cell,
                        t.sblk, t.soff)
        np.minimum.at(t.min_t, ent_s, blk.t_enter[ent_j])
        blk.entering.append(ent_j)
        full_e, at_e = self._count(t, t.n_ent, ent_s, ent_j)
        done = good & ~is_e
        cj, cs, dcell = j[done], slot[done], cell[done]
        t.obs_b.view(OBS_ITEM).reshape(-1)[dcell] = blk.obs_items[cj]
        t.algo.reshape(-1)[dcell] = blk.algo[cj]
        t.flags.reshape(-1)[dcell] = blk.rec["flags"][cj]
        t.cmp_at.reshape(-1)[dcell] = blk.ticket[cj]
        if blk.chunk_base is not None:
            self._keep_chunks(t, blk, cj, dcell)
        state[dcell] |= COMPLETE
        full_c, at_c = self._count(t, t.n_cmp, cs, cj)
        failed = np.zeros(0, np.int64)
        if len(full_e):
            uneven = self.ids.prop("a2a")[t.meta["op"][full_e, 0]]
            mask = np.where(uneven[:, None], _SIG_MASK_UNEVEN, _SIG_MASK)[:, None, :]
            sig = t.meta_w[full_e][:, :, _SIG_WORDS] & mask
            same = (sig == sig[:, :1]).all(axis=(1, 2))
            failed = full_e[~same]
            events.extend((int(a), _DESYNC, c, int(r)) for a, r in zip(
                at_e[~same].tolist(), failed.tolist(), strict=True))
        if len(full_c):
            closing = np.isin(full_c, failed)
            events.extend((int(a), _CLOSE, c, int(r)) for a, r in zip(
                at_c[closing].tolist(), full_c[closing].tolist(), strict=True))
            rows, at = full_c[~closing], at_c[~closing]
            ok = self._verdict(t, rows)
            events.extend((int(a), _DECIDE, c, int(r)) for a, r in zip(
                at[~ok].tolist(), rows[~ok].tolist(), strict=True))
            self._verified += int(ok.sum())
            self._close(t, rows[ok])

    def _keep(self, blk: Block, what: str, table: np.ndarray, count: int) -> int:
        """The id under which ``table`` (the block's chunks or splits) is kept, now that
        ``count`` more cells point into it."""
        key = blk.kept_ids.get(what)
        if key is None:
            key = blk.kept_ids[what] = self._kept_id = self._kept_id + 1
        if key not in self.kept:  # new, or freed after an earlier table's cells closed
            self.kept[key] = table
            self.kept_refs[key] = 0
        self.kept_refs[key] += count
        return key

    def _point(self, blk: Block, what: str, table: np.ndarray, at: np.ndarray,
               cells: np.ndarray, ids: np.ndarray, offs: np.ndarray) -> np.ndarray:
        """Point the ``cells`` whose ``at`` is set (>= 0) at those offsets of ``table`` (the
        block's chunks or splits, kept while they do), through the cell arrays ``ids`` and
        ``offs``; returns which cells."""
        has = at >= 0
        if has.any():
            ids.reshape(-1)[cells[has]] = self._keep(blk, what, table, int(has.sum()))
            offs.reshape(-1)[cells[has]] = at[has]
        return has

    def _keep_chunks(self, t: Table, blk: Block, cj: np.ndarray, cells: np.ndarray) -> None:
        base = blk.chunk_base[cj]
        has = self._point(blk, "chunks", blk.chunk_table, base, cells, t.cblk, t.coff)
        sc = has & blk.scatter[cj]
        if sc.any():  # each member's chunk sums, added up per destination (column)
            sums = blk.chunk_table["sum"][base[sc][:, None] + np.arange(t.n)]
            rows = cells[sc] // t.n
            np.add.at(t.exp, rows, sums)
            np.add.at(t.exp_abs, rows, np.abs(sums))

    def _release(self, t: Table, rows: np.ndarray) -> None:
        """Free rows, and the kept tables no open cell points into any more."""
        held = np.concatenate([t.cblk[rows].ravel(), t.sblk[rows].ravel()]) if self.kept \
            else rows[:0]
        held = held[held >= 0]
        if len(held):
            ids, counts = np.unique(held, return_counts=True)
            for b, k in zip(ids.tolist(), counts.tolist(), strict=True):
                self.kept_refs[b] -= k
                if not self.kept_refs[b]:
                    del self.kept_refs[b], self.kept[b]
        t.release(rows)

    def _chunks(self, t: Table, row: int, col: int) -> tuple:
        """The chunks a fast cell kept, as the exact path's tuples."""
        b = int(t.cblk[row, col])
        if b < 0:
            return ()
        start = int(t.coff[row, col])
        count = 2 * t.n if self.ids.prop("a2a")[t.meta["op"][row, col]] else t.n
        return tuple(map(tuple, self.kept[b][start:start + count].tolist()))

    @staticmethod
    def _count(t: Table, counter: np.ndarray, rows: np.ndarray,
               j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add one per record to its row's counter; rows that reached ``n`` and the block
        index of the record that completed each."""
        if not len(rows):
            return rows, rows
        k = np.bincount(rows, minlength=t.cap)
        touched = np.flatnonzero(k)
        counter[touched] += k[touched]
        full = touched[counter[touched] == t.n]
        if not len(full):
            return full, full
        last = np.full(t.cap, -1, np.int64)
        np.maximum.at(last, rows, j)
        return full, last[full]

    def _verdict(self, t: Table, rows: np.ndarray) -> np.ndarray:
        """True where the exact path would find nothing: equal hashes among members that
        hashed their output, and a checksum clearly within tolerance."""
        if not len(rows):
            return np.zeros(0, bool)
        ids = self.ids
        op = t.meta["op"][rows, 0]
        known = ids.prop("known")[op]
        flags = t.flags[rows]
        algo = t.algo[rows]
        ok = (algo == algo[:, :1]).all(axis=1) | ~known
        repl = ids.prop("replicated")[op]
        if repl.any():
            hashed = (flags & F_OUT_HASH) != 0
            ref = hashed.argmax(axis=1)[:, None]
            h0, h1 = t.obs["out_h0"][rows], t.obs["out_h1"][rows]
            same = (((h0 == np.take_along_axis(h0, ref, axis=1)) &
                     (h1 == np.take_along_axis(h1, ref, axis=1))) | ~hashed).all(axis=1)
            ok &= same | ~repl
        gather = ids.prop("gather")[op] & ok
        if gather.any():
            ok[gather] = self._gathered(t, rows[gather], flags[gather])
        a2a = ids.prop("a2a")[op] & ok
        if a2a.any():
            ok[a2a] = self._exchanged(t, rows[a2a], flags[a2a])
        red = ids.prop("reduction")[op]
        ok &= (red == RED_NONE) | (red == RED_ALL) | (red == RED_SCATTER)
        redop = t.meta["redop"][rows, 0]
        scatter = ok & (red == RED_SCATTER)
        if scatter.any():
            ok[scatter] = self._scattered(t, rows[scatter], flags[scatter], redop[scatter])
        check = ok & (red == RED_ALL) & ids.prop("red_checked")[redop]
        if check.any():
            f = flags[check]
            check[check] = ((f & F_IN_SUMMARY) != 0).all(axis=1) & \
                ((f & F_OUT_SUMMARY) != 0).all(axis=1)
        if check.any():
            ok[check] = self._checksum_ok(t, rows[check], redop[check])
        return ok

    @staticmethod
    def _gathered(t: Table, rows: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """An all_gather row is clean when every member hashed both sides and every output
        hash is the combination of the members' input hashes in group order: each output
        chunk then is what its sender sent (the exact path's link check passes), and the
        outputs agree. Anything else (one receiver's chunk, or one sender's data to all,
        differs) goes to the exact path with the kept chunks."""
        hashed = ((flags & F_IN_HASH) != 0).all(axis=1) & \
            ((flags & F_OUT_HASH) != 0).all(axis=1)
        ok = np.zeros(len(rows), bool)
        ins = np.stack([t.obs["in_h0"][rows], t.obs["in_h1"][rows]], axis=2).astype("<u8")
        out0, out1 = t.obs["out_h0"][rows, 0], t.obs["out_h1"][rows, 0]
        for i in np.flatnonzero(hashed).tolist():
            h = xxhash.xxh3_128_intdigest(ins[i].tobytes())
            ok[i] = (h & _LOW64) == int(out0[i]) and h >> 64 == int(out1[i])
        return ok

    def _exchanged(self, t: Table, rows: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """An all_to_all row is clean when every output chunk from s on d hashes like the
        input chunk s sent to d, wherever s hashed its input and d its output (the exact
        path's link check). Needs every member's kept chunks (input then output)."""
        n = t.n
        cblk, coff = t.cblk[rows], t.coff[rows]
        ok = (cblk >= 0).all(axis=1)
        h = np.zeros((len(rows), n, 2 * n, 2), np.uint64)
        k = np.arange(2 * n)
        for b in np.unique(cblk[ok]).tolist():
            at = ok[:, None] & (cblk == b)
            table = self.kept[b]
            pos = coff[at][:, None] + k
            h[at, :, 0], h[at, :, 1] = table["h0"][pos], table["h1"][pos]
        sent, got = h[:, :, :n], h[:, :, n:].transpose(0, 2, 1, 3)  # both [row, src, dst]
        checked = ((flags & F_IN_HASH) != 0)[:, :, None] & ((flags & F_OUT_HASH) != 0)[:, None, :]
        return ok & ~((sent != got).any(axis=3) & checked).any(axis=(1, 2))

    def _scattered(self, t: Table, rows: np.ndarray, flags: np.ndarray,
                   redop: np.ndarray) -> np.ndarray:
        """reduce_scatter rows the exact path would pass: its reduction check (each
        member's output sum against the chunk sums sent to it) is skipped for reduce ops
        it does not check or without summaries, else must hold clearly within tolerance,
        with a margin for the exact path's summation order (as in :meth:`_checksum_ok`)."""
        ok = np.ones(len(rows), bool)
        check = self.ids.prop("red_checked")[redop] & \
            ((flags & F_IN_SUMMARY) != 0).all(axis=1) & ((flags & F_OUT_SUMMARY) != 0).all(axis=1)
        if not check.any():
            return ok
        rows, redop = rows[check], redop[check]
        n = t.n
        scale = np.where(self.ids.prop("avg")[redop], 1.0 / n, 1.0)[:, None]
        tol = _tolerance(n, self.ids.prop("unit")[t.meta["dtype"][rows, 0]][:, None],
                         t.meta["numel_out"][rows],
                         t.obs["in_absmax"][rows].sum(axis=1)[:, None])
        ok[check] = _clearly_within(n, tol, t.exp[rows] * scale, t.exp_abs[rows] * scale,
                                    t.obs["out_sum"][rows]).all(axis=1)
        return ok

    def _checksum_ok(self, t: Table, rows: np.ndarray, redop: np.ndarray) -> np.ndarray:
        """|Σ in_sum − out_sum| within ``reduction_tolerance`` with a margin that covers any
        summation order (the exact path sums in arrival order)."""
        n = t.n
        scale = np.where(self.ids.prop("avg")[redop], 1.0 / n, 1.0)[:, None]
        in_sum = t.obs["in_sum"][rows]
        tol = _tolerance(n, self.ids.prop("unit")[t.meta["dtype"][rows, 0]][:, None],
                         t.meta["numel_out"][rows, :1],
                         t.obs["in_absmax"][rows].sum(axis=1)[:, None])
        return _clearly_within(n, tol, in_sum.sum(axis=1)[:, None] * scale,
                               np.abs(in_sum).sum(axis=1)[:, None] * scale,
                               t.obs["out_sum"][rows]).all(axis=1)

    def _close(self, t: Table, rows: np.ndarray) -> None:
        """Rows decided clean: free them and their ring slots."""
        if not len(rows):
            return
        w, s = t.wid[rows], t.seq[rows]
        r = self.rings
        r.flat[r.off[w] + (s & (r.size[w] - 1))] = EMPTY
        self._touched.update(np.unique(w).tolist())
        self._release(t, rows)

    def _drop_fresh(self, t: Table, rows: np.ndarray, blk: Block) -> None:
        """Rows opened in this block for keys that turned out to need the exact path."""
        fresh = np.unique(rows[t.born[rows] >= blk.ticket0])
        if len(fresh):
            self._close(t, fresh)

    # -- exact path, in block order -------------------------------------------------------------

    def _run(self, blk: Block, slow: np.ndarray, events: list[Event]) -> list[Finding]:
        findings: list[Finding] = []
        if not len(slow) and not events:
            return findings
        events.sort()
        ei, n_ev = 0, len(events)
        for j in [*slow.tolist(), len(blk.wid)]:
            while ei < n_ev and events[ei][0] < j:
                self._event(events[ei], findings)
                ei += 1
            if j < len(blk.wid):
                self._replay(blk, j, findings)
        return findings

    def _replay(self, blk: Block, j: int, findings: list[Finding]) -> None:
        w, seq = int(blk.wid[j]), int(blk.seq[j])
        p = -1 if blk.huge[j] else self.ring_pos(w, seq)
        if p >= 0 and self.rings.flat[p] >= 0:  # an open fast row: hand it over first
            key, ok = self.convert(int(self.wcls[w]), int(self.rings.flat[p]))
            self.eng.open[key] = ok
            self.rings.flat[p] = SLOW
        rows, i = blk.rows(j)
        self.eng._record(rows, i, int(blk.ticket[j]), w, blk.on_enter, findings)

    def _event(self, ev: Event, findings: list[Finding]) -> None:
        _, kind, c, row = ev
        t = self.tables[c]
        w, seq = int(t.wid[row]), int(t.seq[row])
        win = self.ids.windows[w]
        eng = self.eng
        if kind == _CLOSE:
            key: Key = (win.run, win.name, win.ranks, seq)
            ok = eng.open[key]
            if len(ok.complete) == len(win.ranks):
                del eng.open[key]
                self.closed(ok, seq)
                if not ok.desynced:
                    findings.extend(eng._decide(key, ok.complete))
            return
        p = self.ring_pos(w, seq)
        key, ok = self.convert(c, row)
        if kind == _DESYNC:
            eng.open[key] = ok
            self.rings.flat[p] = SLOW
            found = desync(win.run, win.label, seq, ok.entered)
            ok.desynced = bool(found)
            findings.extend(found)
            # A _CLOSE event for this key may follow: it finds the key through the freed
            # row's wid/seq, which nothing reallocates while events run.
        else:
            self.rings.flat[p] = EMPTY
            self._touched.add(w)
            findings.extend(eng._decide(key, ok.complete))

    # -- rows as the exact path's objects -------------------------------------------------------

    def metas(self, c: int, row: int) -> dict[int, Meta]:
        t = self.tables[c]
        cols = np.flatnonzero(t.state[row] & ENTERED)
        cols = cols[np.argsort(t.ent_at[row, cols], kind="stable")]
        metas = self._meta_list(t.meta[row, cols])
        held = t.sblk[row, cols]
        for i in np.flatnonzero(held >= 0).tolist():
            at, n = int(t.soff[row, cols[i]]), t.n
            sizes = self.kept[int(held[i])][at:at + 2 * n].tolist()
            metas[i] = metas[i]._replace(in_splits=tuple(sizes[:n]),
                                         out_splits=tuple(sizes[n:]))
        return dict(zip(self._ranks(t, row, cols), metas, strict=True))

    def _ranks(self, t: Table, row: int, cols: np.ndarray) -> list[int]:
        ranks = self.ids.windows[int(t.wid[row])].ranks
        return [ranks[k] for k in cols.tolist()]

    def _meta_list(self, m: np.ndarray) -> list[Meta]:
        return meta_list(self.ids, m)

    def convert(self, c: int, row: int) -> tuple[Key, OpenKey]:
        """Hand a fast row over to the exact path as an OpenKey (the row is freed; the
        caller sets its ring slot)."""
        t = self.tables[c]
        w, seq = int(t.wid[row]), int(t.seq[row])
        win = self.ids.windows[w]
        entered = {r: m._replace(rank=r) for r, m in self.metas(c, row).items()}
        cols = np.flatnonzero(t.state[row] & COMPLETE)
        cols = cols[np.argsort(t.cmp_at[row, cols], kind="stable")]
        complete: dict[int, Obs] = {}
        if len(cols):
            o = {name: t.obs[name][row, cols].tolist() for name in OBS_DTYPE.names}
            o["algo"], o["flags"] = t.algo[row, cols].tolist(), t.flags[row, cols].tolist()
            s = self.ids.strings
            for i, r in enumerate(self._ranks(t, row, cols)):
                m = entered[r]
                complete[r] = Obs(
                    r, m.host, m.op, m.dtype, m.redop, m.root, s[o["algo"][i]], m.callsite,
                    o["flags"][i], m.numel_in, m.numel_out, m.step, o["t_done"][i],
                    (o["in_h0"][i], o["in_h1"][i]), (o["out_h0"][i], o["out_h1"][i]),
                    o["in_sum"][i], o["in_absmax"][i], 0, 0, o["out_sum"][i],
                    o["out_absmax"][i], 0, 0, self._chunks(t, row, int(cols[i])))
        ok = OpenKey(entered, complete, desync_checked=int(t.n_ent[row]) == t.n,
                     hang_reported=bool(t.hang[row]), born=int(t.born[row]), wid=w)
        self._release(t, np.array([row]))
        return (win.run, win.name, win.ranks, seq), ok

    # -- hangs, eviction --------------------------------------------------------------------------

    def hang_candidates(self, now: float, final: bool, timeout: float
                        ) -> list[tuple[int, Key, OpenKey, Callable[[], None]]]:
        """Open rows some member has not entered (past the timeout unless ``final``), as
        (born, key, a read-only OpenKey view, mark-as-reported)."""
        out = []
        for c, t in enumerate(self.tables):
            m = t.used & ~t.hang & (t.n_ent > 0) & (t.n_ent < t.n)
            if not final:
                m &= now - t.min_t >= timeout
            for row in np.flatnonzero(m).tolist():
                w, seq = int(t.wid[row]), int(t.seq[row])
                win = self.ids.windows[w]
                entered = {r: v._replace(rank=r) for r, v in self.metas(c, row).items()}
                view = OpenKey(entered, born=int(t.born[row]), wid=w)
                out.append((int(t.born[row]), (win.run, win.name, win.ranks, seq), view,
                            _marker(t, row)))
        return out

    def _evict_below(self, w: int, new_base: int) -> None:
        """Slide window ``w`` up to ``new_base``, dropping the fast rows under it."""
        r = self.rings
        pos = r.positions(w)[:max(0, min(int(r.size[w]), new_base - int(r.base[w])))]
        vals = r.flat[pos]
        rows = vals[vals >= 0]
        if len(rows):
            self._evict(self.tables[int(self.wcls[w])], rows)
        r.flat[pos] = EMPTY  # exact-path keys under the base stay in Engine.open
        r.base[w] = new_base
        r.floor[w] = max(int(r.floor[w]), new_base)

    def _evict(self, t: Table, rows: np.ndarray) -> None:
        r = self.rings
        w, s = t.wid[rows], t.seq[rows]
        r.flat[r.off[w] + (s & (r.size[w] - 1))] = EMPTY
        np.maximum.at(r.floor, w, s + 1)
        self.eng.stats.evicted += len(rows)
        self._release(t, rows)

    def _evict_cells(self) -> None:
        """Past ``max_cells``, drop the oldest rows (by the ticket that opened them)."""
        used = sum(t.rows_open * t.n for t in self.tables)
        if used <= self.max_cells:
            return
        cand = [(t.born[t.used], c, np.flatnonzero(t.used)) for c, t in enumerate(self.tables)]
        born = np.concatenate([b for b, _, _ in cand])
        cls = np.concatenate([np.full(len(b), c) for b, c, _ in cand])
        rows = np.concatenate([r for _, _, r in cand])
        sizes = np.array(self.ids.sizes)[cls]
        order = np.argsort(born, kind="stable")
        freed = np.cumsum(sizes[order])
        k = int(np.searchsorted(freed, used - self.max_cells * 7 // 8)) + 1
        victims = order[:k]
        for c in np.unique(cls[victims]).tolist():
            v = victims[cls[victims] == c]
            self._evict(self.tables[c], rows[v])
            self._touched.update(np.unique(self.tables[c].wid[rows[v]]).tolist())

    def _settle_last(self, blk: Block) -> None:
        """Each rank's last entered collective (for missing_rank details): the entering
        record with the largest t_enter, the latest among equals — what the sequential
        ``>=`` update yields when every t_enter is finite (blocks with others are exact)."""
        best: dict[int, tuple[float, int, Callable[[], tuple[str, Meta]]]] = {}
        ent = np.concatenate(blk.entering) if blk.entering else np.zeros(0, np.int64)
        if len(ent):
            rs = blk.rank_slot[ent]
            t = blk.t_enter[ent]
            top = np.full(len(blk.states), -np.inf)
            np.maximum.at(top, rs, t)
            at = t == top[rs]
            last = np.full(len(blk.states), -1, np.int64)
            np.maximum.at(last, rs[at], ent[at])
            for k in np.flatnonzero(last >= 0).tolist():
                j = int(last[k])
                best[k] = (float(top[k]), j, blk.last_maker(j))
        for k, (tv, j, make) in blk.slow_last.items():
            cur = best.get(k)
            if cur is None or (tv, j) > (cur[0], cur[1]):
                best[k] = (tv, j, make)
        for k, (tv, _, make) in best.items():
            state = blk.states[k]
            # An unset last compares as -inf; a NaN one (from an exact block) never yields.
            if state.last_t_enter <= tv:
                state.set_last_lazily(tv, make)


def _tolerance(n: int, unit: np.ndarray, numel: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    """``verdicts.reduction_tolerance`` on arrays (numel 0 counts as 1, as there)."""
    return (n + 20) * unit * np.maximum(numel, 1).astype(np.float64) * absmax + 1e-30


def _clearly_within(n: int, tol: np.ndarray, expected: np.ndarray, spread: np.ndarray,
                    out_sum: np.ndarray) -> np.ndarray:
    """|out_sum − expected| within ``tol`` with a margin for summation order: the exact
    path sums the ``n`` terms (of magnitudes adding up to ``spread``) in arrival order, so
    a clean verdict here holds whatever order it uses. Arrays broadcast."""
    slack = (n + 4) * _EPS * (spread + np.abs(out_sum))
    return np.abs(out_sum - expected) + slack <= tol * (1 - (n + 4) * _EPS)


def _marker(t: Table, row: int) -> Callable[[], None]:
    def mark() -> None:
        t.hang[row] = True
    return mark
