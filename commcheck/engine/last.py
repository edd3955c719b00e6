"""Each rank's last entered collective (for missing_rank details), as the fast path keeps it.

The exact path sets a rank's ``last`` at every entry with a newer (or equal) t_enter. The
fast path gets the same result a block at a time: :class:`LastEntries` collects the block's
entering records from both paths and, at the block's end, gives each rank the one with the
largest t_enter (the latest among equals) — what the sequential ``>=`` update yields when
every t_enter is finite (blocks with others take the exact path whole). The (label, Meta)
is built only when a hang report reads it (:class:`LastEntry`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .block import RecordBlock
from .cells import META_DTYPE, meta_list
from .ids import Ids
from .model import Meta, group_label

Maker = Callable[[], tuple[str, Meta]]


class LastEntries:
    """One block's candidates for each rank's ``last``; :meth:`settle` sets them."""

    def __init__(self, blk: RecordBlock):
        self.blk = blk
        self.fast: list[np.ndarray] = []  # records that entered a cell on the fast path
        # per rank slot (RecordBlock.states): (t_enter, record, maker) of its latest entry
        # on the exact path
        self.exact: dict[int, tuple[float, int, Maker]] = {}

    def entered_fast(self, recs: np.ndarray) -> None:
        self.fast.append(recs)

    def entered_exact(self, rank: int, gname: str, granks: tuple[int, ...], seq: int,
                      meta: Meta, ticket: int) -> None:
        """The exact path entered a member (an ``OnEnter``)."""
        blk = self.blk
        j = ticket - blk.ticket0
        rank_slot = int(blk.rank_slot[j])
        if blk.all_exact:  # no settling: the sequential update, as the exact path does
            blk.states[rank_slot].entered(gname, granks, seq, meta)
            return
        cur = self.exact.get(rank_slot)
        if cur is None or (meta.t_enter, j) > (cur[0], cur[1]):
            self.exact[rank_slot] = (meta.t_enter, j, Known(
                (f"{group_label(gname, granks)} seq {seq}", meta)))

    def settle(self) -> None:
        """Give each rank of the block its latest entry, unless it has a later one."""
        best = self._latest_fast()
        for rank_slot, (t_enter, j, make) in self.exact.items():
            cur = best.get(rank_slot)
            if cur is None or (t_enter, j) > (cur[0], cur[1]):
                best[rank_slot] = (t_enter, j, make)
        for rank_slot, (t_enter, _, make) in best.items():
            state = self.blk.states[rank_slot]
            # An unset last compares as -inf; a NaN one (from an exact block) never yields.
            if state.last_t_enter <= t_enter:
                state.set_last_lazily(t_enter, make)

    def _latest_fast(self) -> dict[int, tuple[float, int, Maker]]:
        """Per rank slot, the fast entry with the largest t_enter (the latest among equals)."""
        blk = self.blk
        best: dict[int, tuple[float, int, Maker]] = {}
        if not self.fast:
            return best
        recs = np.concatenate(self.fast)
        if not len(recs):
            return best
        slot = blk.rank_slot[recs]
        t_enter = blk.t_enter[recs]
        top = np.full(len(blk.states), -np.inf)
        np.maximum.at(top, slot, t_enter)
        at_top = t_enter == top[slot]
        last = np.full(len(blk.states), -1, np.int64)
        np.maximum.at(last, slot[at_top], recs[at_top])
        for rank_slot in np.flatnonzero(last >= 0).tolist():
            j = int(last[rank_slot])
            best[rank_slot] = (float(top[rank_slot]), j, self._maker(j))
        return best

    def _maker(self, j: int) -> LastEntry:
        """Builds (label, Meta) of record ``j`` as the exact path would have stored it; keeps
        a copy of the one row, not the block."""
        blk = self.blk
        rank = blk.batches[int(blk.batch_of[j])].env.rank
        win, seq = blk.ids.windows[int(blk.wid[j])], int(blk.seq[j])
        # a plain copy: structured ones go field by field
        return LastEntry(blk.ids, f"{win.label} seq {seq}", blk.meta_words[j].copy(), rank,
                         blk.splits_of(j))


class LastEntry:
    """A rank's last entered collective as (label, Meta), built when a hang report needs
    it; a class rather than a closure so that the engine's snapshot can pickle it."""

    __slots__ = ("ids", "label", "words", "rank", "splits")

    def __init__(self, ids: Ids, label: str, words: np.ndarray, rank: int,
                 splits: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())):
        self.ids, self.label, self.words, self.rank = ids, label, words, rank
        self.splits = splits

    def __call__(self) -> tuple[str, Meta]:
        meta = meta_list(self.ids, self.words.view(META_DTYPE))[0]
        return self.label, meta._replace(rank=self.rank, in_splits=self.splits[0],
                                         out_splits=self.splits[1])

    def __getstate__(self) -> tuple:
        return self.ids, self.label, self.words, self.rank, self.splits

    def __setstate__(self, state: tuple) -> None:
        self.ids, self.label, self.words, self.rank, self.splits = state


class Known:
    """A last entry built already (by the exact path), in :class:`LastEntry`'s shape."""

    __slots__ = ("value",)

    def __init__(self, value: tuple[str, Meta]):
        self.value = value

    def __call__(self) -> tuple[str, Meta]:
        return self.value

    def __getstate__(self) -> tuple:
        return self.value

    def __setstate__(self, state: tuple) -> None:
        self.value = state
