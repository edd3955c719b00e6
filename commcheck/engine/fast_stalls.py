"""What the stall checks (``stalls.py``) ask of the fast path: its open rows that wait too
long (hangs) or wait for a given rank (what a dead rank leaves behind). Each answer is a
:class:`~.handoff.Pending` whose Metas are built only if a report reads them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

import numpy as np

from .cells import COMPLETE, ENTERED, Table
from .fast_convert import RowReader
from .handoff import Pending
from .ids import Ids


class FastStalls:
    """Stall queries over the fast path's ``tables`` (rows read through ``reader``)."""

    def __init__(self, ids: Ids, tables: list[Table], reader: RowReader):
        self.ids = ids
        self.tables = tables
        self.reader = reader

    def hang_candidates(self, now: float, final: bool, timeout: float) -> list[Pending]:
        """Open rows not reported yet whose first member entered ``timeout`` s before
        ``now`` (any, if ``final``): some members have not entered, or all have and not all
        completed. A row's Metas are built only if a report reads them."""
        out = []
        for tid, table in enumerate(self.tables):
            waiting = table.used & ~table.hang & (table.n_ent > 0)
            if not final:
                waiting &= now - table.min_t >= timeout
            out += [self._pending(tid, row) for row in np.flatnonzero(waiting).tolist()]
        return out

    def involving(self, rank: int, run: str) -> list[Pending]:
        """Open rows of ``run``'s groups that ``rank`` is a member of and did not complete
        while another member entered (what a dead rank leaves waiting), reported or not."""
        wids = [w for w, win in enumerate(self.ids.windows)
                if win.run == run and _member(win.ranks, rank)]
        out: list[Pending] = []
        if not wids:
            return out
        wids_a = np.array(wids, np.int64)
        for tid, table in enumerate(self.tables):
            rows = np.flatnonzero(table.used & np.isin(table.wid, wids_a))
            if not len(rows):
                continue
            cols = np.array([self.ids.windows[w].col(rank) for w in table.wid[rows].tolist()],
                            np.int64)
            mine = table.state[rows, cols]
            others = table.n_ent[rows] - ((mine & ENTERED) != 0)
            keep = ((mine & COMPLETE) == 0) & (others > 0)
            out += [self._pending(tid, row) for row in rows[keep].tolist()]
        return out

    def _pending(self, tid: int, row: int) -> Pending:
        table = self.tables[tid]
        wid = int(table.wid[row])
        win = self.ids.windows[wid]
        state = table.state[row]
        members = np.flatnonzero(state & ENTERED)
        t_enter = table.meta["t_enter"][row, members]
        return Pending(
            int(table.born[row]), (win.run, win.name, win.ranks, int(table.seq[row])),
            set(self.reader.ranks(table, row, members)),
            set(self.reader.ranks(table, row, np.flatnonzero(state & COMPLETE))),
            float(t_enter.min()), float(t_enter.max()), _marker(table, row),
            make=lambda: self.reader.metas(tid, row))



def _marker(table: Table, row: int) -> Callable[[], None]:
    def mark() -> None:
        table.hang[row] = True
    return mark


def _member(ranks: tuple[int, ...], rank: int) -> bool:
    """Whether ``rank`` is one of the ascending ``ranks``."""
    i = bisect_left(ranks, rank)
    return i < len(ranks) and ranks[i] == rank
