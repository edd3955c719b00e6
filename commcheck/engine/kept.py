"""Blocks' chunk tables (``RecordBlock.chunks``) and split-size tables (``.splits``) that
open fast cells still point into, kept by id with how many cells point into each, so a
block's tables live exactly as long as a cell needs them."""

from __future__ import annotations

import numpy as np

from .cells import Table
from .ids import Ids


class Kept:
    """The kept tables (``tables``, by id) and their reference counts (``refs``)."""

    def __init__(self) -> None:
        self.tables: dict[int, np.ndarray] = {}
        self.refs: dict[int, int] = {}
        self._last_id = 0

    @classmethod
    def restore(cls, tables: dict[int, np.ndarray], refs: dict[int, int],
                last_id: int) -> Kept:
        """Kept tables as an older snapshot held them (three attributes of the fast path)."""
        kept = cls()
        kept.tables, kept.refs, kept._last_id = tables, refs, last_id
        return kept

    def keep(self, block_ids: dict[str, int], what: str, source: np.ndarray,
             count: int) -> int:
        """The id under which ``source`` (the block's chunks or splits; ``block_ids``: the
        ids the block's tables are kept under) is kept, now that ``count`` more cells point
        into it."""
        key = block_ids.get(what)
        if key is None:
            key = block_ids[what] = self._last_id = self._last_id + 1
        if key not in self.tables:  # new, or freed after an earlier table's cells closed
            self.tables[key] = source
            self.refs[key] = 0
        self.refs[key] += count
        return key

    def point(self, block_ids: dict[str, int], what: str, source: np.ndarray,
              at: np.ndarray, cells: np.ndarray, source_ids: np.ndarray,
              offsets: np.ndarray) -> np.ndarray:
        """Point the ``cells`` whose ``at`` is set (>= 0) at those offsets of ``source`` (the
        block's chunks or splits, kept while they do), through the cell arrays
        ``source_ids`` and ``offsets``; returns which cells."""
        has = at >= 0
        if has.any():
            source_ids.reshape(-1)[cells[has]] = self.keep(block_ids, what, source,
                                                           int(has.sum()))
            offsets.reshape(-1)[cells[has]] = at[has]
        return has

    def release(self, table: Table, rows: np.ndarray) -> None:
        """Rows about to be freed: drop the kept tables no open cell points into any more."""
        held = np.concatenate([table.cblk[rows].ravel(), table.sblk[rows].ravel()]) \
            if self.tables else rows[:0]
        held = held[held >= 0]
        if len(held):
            ids, counts = np.unique(held, return_counts=True)
            for b, k in zip(ids.tolist(), counts.tolist(), strict=True):
                self.refs[b] -= k
                if not self.refs[b]:
                    del self.refs[b], self.tables[b]

    def chunks(self, ids: Ids, table: Table, row: int, member: int) -> tuple:
        """The chunks a fast cell kept, as the exact path's tuples."""
        b = int(table.cblk[row, member])
        if b < 0:
            return ()
        start = int(table.coff[row, member])
        count = 2 * table.n if ids.prop("a2a")[table.meta["op"][row, member]] else table.n
        return tuple(map(tuple, self.tables[b][start:start + count].tolist()))

    def splits(self, table: Table, row: int, member: int) -> tuple[tuple, tuple]:
        """The split sizes a fast cell kept (input, output); the cell must hold some."""
        held = int(table.sblk[row, member])
        at, n = int(table.soff[row, member]), table.n
        sizes = self.tables[held][at:at + 2 * n].tolist()
        return tuple(sizes[:n]), tuple(sizes[n:])
