"""A fast row read back as the exact path's objects: each member's Meta (what it entered)
and Obs (what it reported), for a row handed over to the exact path (``FastPath.convert``)
or a stall report. Only rows that leave the fast path, or that a report reads, are ever
built into Python objects."""

from __future__ import annotations

import numpy as np

from .cells import COMPLETE, ENTERED, OBS_DTYPE, Table, meta_list
from .ids import Ids
from .kept import Kept
from .model import Meta, Obs


class RowReader:
    """Reads rows of the fast path's ``tables`` (with the engine's ``ids`` and the kept
    chunk and split tables) as Metas and Obs, by rank."""

    def __init__(self, ids: Ids, tables: list[Table], kept: Kept):
        self.ids = ids
        self.tables = tables
        self.kept = kept

    def metas(self, tid: int, row: int) -> dict[int, Meta]:
        """What each member that entered a row said, by rank, in the order they entered."""
        table = self.tables[tid]
        members = np.flatnonzero(table.state[row] & ENTERED)
        members = members[np.argsort(table.ent_at[row, members], kind="stable")]
        metas = meta_list(self.ids, table.meta[row, members])
        held = table.sblk[row, members]
        for i in np.flatnonzero(held >= 0).tolist():
            in_splits, out_splits = self.kept.splits(table, row, int(members[i]))
            metas[i] = metas[i]._replace(in_splits=in_splits, out_splits=out_splits)
        return {r: m._replace(rank=r) for r, m in zip(
            self.ranks(table, row, members), metas, strict=True)}

    def ranks(self, table: Table, row: int, members: np.ndarray) -> list[int]:
        ranks = self.ids.windows[int(table.wid[row])].ranks
        return [ranks[k] for k in members.tolist()]

    def observations(self, table: Table, row: int, entered: dict[int, Meta]
                     ) -> dict[int, Obs]:
        """What each member that completed a row reported, by rank, in completion order."""
        members = np.flatnonzero(table.state[row] & COMPLETE)
        members = members[np.argsort(table.cmp_at[row, members], kind="stable")]
        complete: dict[int, Obs] = {}
        if not len(members):
            return complete
        o = {name: table.obs[name][row, members].tolist() for name in OBS_DTYPE.names}
        o["algo"], o["flags"] = table.algo[row, members].tolist(), \
            table.flags[row, members].tolist()
        s = self.ids.strings
        for i, r in enumerate(self.ranks(table, row, members)):
            m = entered[r]
            chunks = self.kept.chunks(self.ids, table, row, int(members[i]))
            complete[r] = Obs(
                r, m.host, m.op, m.dtype, m.redop, m.root, s[o["algo"][i]], m.callsite,
                o["flags"][i], m.numel_in, m.numel_out, m.step, o["t_done"][i],
                (o["in_h0"][i], o["in_h1"][i]), (o["out_h0"][i], o["out_h1"][i]),
                o["in_sum"][i], o["in_absmax"][i], 0, 0, o["out_sum"][i],
                o["out_absmax"][i], 0, 0, chunks)
        return complete

