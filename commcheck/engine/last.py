"""Each rank's last entered and last completed collective, as the fast path keeps them (for
missing_rank, rank_died and hang details, and a rank's condition).

The exact path sets a rank's ``last`` at every entry with a newer (or equal) t_enter, and
its ``last_done`` at every completion (the latest to arrive: a rank's records arrive in the
order it wrote them). The fast path gets the same result a block at a time:
:class:`LastEntries` collects the block's entering and completing records from both paths
and, at the block's end, gives each rank the entry with the largest t_enter (the latest
among equals) — what the sequential ``>=`` update yields when every t_enter is finite
(blocks with others take the exact path whole) — and the completion that came last. The
:class:`~.state.Call` is built only when something reads it (:class:`LastEntry`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .block import RecordBlock
from .cells import META_DTYPE, meta_list
from .ids import Ids
from .model import Key, Meta
from .state import Call

Maker = Callable[[], Call]


class LastEntries:
    """One block's candidates for each rank's ``last`` and ``last_done``; :meth:`settle` sets
    them. Its :meth:`entered` and :meth:`completed` are the exact path's ``Books``."""

    def __init__(self, blk: RecordBlock):
        self.blk = blk
        self.fast: list[np.ndarray] = []  # records that entered a cell on the fast path
        self.fast_done: list[np.ndarray] = []  # records that completed one there
        # per rank slot (RecordBlock.states): (t_enter, record, maker) of its latest entry
        # on the exact path, and (record, maker) of its last completion there
        self.exact: dict[int, tuple[float, int, Maker]] = {}
        self.exact_done: dict[int, tuple[int, Maker]] = {}

    def entered_fast(self, recs: np.ndarray) -> None:
        self.fast.append(recs)

    def completed_fast(self, recs: np.ndarray) -> None:
        self.fast_done.append(recs)

    def entered(self, rank: int, key: Key, meta: Meta, ticket: int) -> None:
        """The exact path entered a member."""
        blk = self.blk
        j = ticket - blk.ticket0
        rank_slot = int(blk.rank_slot[j])
        if blk.all_exact:  # no settling: the sequential update, as the exact path does
            blk.states[rank_slot].entered(key, meta)
            return
        cur = self.exact.get(rank_slot)
        if cur is None or (meta.t_enter, j) > (cur[0], cur[1]):
            self.exact[rank_slot] = (meta.t_enter, j, Known(Call(key, meta)))

    def completed(self, rank: int, key: Key, meta: Meta, t_done: float, ticket: int) -> None:
        """The exact path took a member's completion."""
        blk = self.blk
        j = ticket - blk.ticket0
        rank_slot = int(blk.rank_slot[j])
        if blk.all_exact:
            blk.states[rank_slot].completed(key, meta, t_done)
            return
        cur = self.exact_done.get(rank_slot)
        if cur is None or j > cur[0]:
            self.exact_done[rank_slot] = (j, Known(Call(key, meta, t_done)))

    def settle(self) -> None:
        """Give each rank of the block its latest entry, unless it has a later one, and its
        last completion."""
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
        done = self._last_fast_done()
        for rank_slot, (j, make) in self.exact_done.items():
            cur = done.get(rank_slot)
            if cur is None or j > cur[0]:
                done[rank_slot] = (j, make)
        for rank_slot, (_, make) in done.items():
            self.blk.states[rank_slot].set_last_done_lazily(make)

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
        slots = np.flatnonzero(last >= 0)
        makers = self._makers(last[slots])
        for rank_slot, t, j, make in zip(slots.tolist(), top[slots].tolist(),
                                         last[slots].tolist(), makers, strict=True):
            best[rank_slot] = (t, j, make)
        return best

    def _last_fast_done(self) -> dict[int, tuple[int, Maker]]:
        """Per rank slot, its last completing record on the fast path. A batch is one rank's
        and its records are contiguous, so: the last one of each batch, then of each rank."""
        blk = self.blk
        done: dict[int, tuple[int, Maker]] = {}
        if not self.fast_done:
            return done
        recs = np.concatenate(self.fast_done)
        if not len(recs):
            return done
        at = np.full(blk.n, -1, np.int64)
        at[recs] = recs
        per_batch = np.maximum.reduceat(at, blk.starts)
        last = np.full(len(blk.states), -1, np.int64)
        np.maximum.at(last, blk.rank_slot[blk.starts], per_batch)
        slots = np.flatnonzero(last >= 0)
        js = last[slots]
        makers = self._makers(js, blk.rec["t_done"][js].tolist())
        for rank_slot, j, make in zip(slots.tolist(), js.tolist(), makers, strict=True):
            done[rank_slot] = (j, make)
        return done

    def _makers(self, js: np.ndarray, t_done: list[float] | None = None) -> list[LastEntry]:
        """Makers of the Calls of records ``js`` as the exact path would have stored them;
        they keep a copy of those rows (one array for all), not the block."""
        blk = self.blk
        words = blk.meta_words[js]  # fancy indexing copies
        windows, batches = blk.ids.windows, blk.batches
        nan = float("nan")
        out = []
        for k, (j, w, b, seq) in enumerate(zip(js.tolist(), blk.wid[js].tolist(),
                                               blk.batch_of[js].tolist(), blk.seq[js].tolist(),
                                               strict=True)):
            win = windows[w]
            out.append(LastEntry(blk.ids, (win.run, win.name, win.ranks, seq), words[k],
                                 batches[b].env.rank, blk.splits_of(j),
                                 nan if t_done is None else t_done[k]))
        return out


class LastEntry:
    """A rank's last entered (or completed) collective as a :class:`~.state.Call`, built
    when a report needs it; a class rather than a closure so that the engine's snapshot
    can pickle it."""

    __slots__ = ("ids", "key", "words", "rank", "splits", "t_done")

    def __init__(self, ids: Ids, key: Key, words: np.ndarray, rank: int,
                 splits: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
                 t_done: float = float("nan")):
        self.ids, self.key, self.words, self.rank = ids, key, words, rank
        self.splits, self.t_done = splits, t_done

    def __call__(self) -> Call:
        meta = meta_list(self.ids, self.words.view(META_DTYPE))[0]
        return Call(self.key, meta._replace(rank=self.rank, in_splits=self.splits[0],
                                            out_splits=self.splits[1]), self.t_done)

    def __getstate__(self) -> tuple:
        """The words as bytes: every commit's snapshot pickles two of these per rank, and a
        small array costs ~10x a bytes object to pickle."""
        return self.ids, self.key, self.words.tobytes(), self.rank, self.splits, self.t_done

    def __setstate__(self, state: tuple) -> None:
        self.ids, self.key, words, self.rank, self.splits, self.t_done = state
        self.words = np.frombuffer(words, np.uint64) if isinstance(words, bytes) else words


class Known:
    """A Call built already (by the exact path), in :class:`LastEntry`'s shape."""

    __slots__ = ("value",)

    def __init__(self, value: Call):
        self.value = value

    def __call__(self) -> Call:
        return self.value

    def __getstate__(self) -> tuple:
        return self.value

    def __setstate__(self, state: tuple) -> None:
        self.value = state
