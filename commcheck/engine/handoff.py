"""The one interface between the engine's two paths: what the fast path may ask of the exact
path, and the values that cross between them.

The fast path (``fastpath.py``) decides clean traffic a block at a time; whatever it cannot
decide it hands to the exact path (``exact.py``), the only place that builds findings.
All the fast path knows of the exact path is :class:`Handoff`; the exact path knows
nothing of the fast path. The :class:`~.core.Engine` builds both and tells the fast path
which keys the exact path evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from ..wire import PHASE_ENTRY, Batch
from .model import Finding, Key, Meta, Obs

HUGE_SEQ = 1 << 62  # sequence numbers from here on are never fast (ring arithmetic)


class Books(Protocol):
    """Who hears of members entering and completing keys on the exact path (each rank's
    last entered and last completed call): the engine, or the fast path's block."""

    def entered(self, rank: int, key: Key, meta: Meta, ticket: int) -> None:
        """``rank`` entered ``key`` (its first record for the key), with arrival ``ticket``."""

    def completed(self, rank: int, key: Key, meta: Meta, t_done: float, ticket: int) -> None:
        """``rank``'s completion record for ``key`` (``meta``: what that record says)."""


@dataclass
class OpenKey:
    """One collective some members have not completed yet, as the exact path holds it."""

    entered: dict[int, Meta] = field(default_factory=dict)
    complete: dict[int, Obs] = field(default_factory=dict)
    desync_checked: bool = False
    desynced: bool = False
    hang_reported: bool = False
    born: int = 0  # ticket of the record that opened the key: hangs are reported in this order
    wid: int = -1  # the fast path's window, when it knows the group


class Rows:
    """One batch's records as Python values, for the per-record (exact) path."""

    def __init__(self, batch: Batch):
        env, rec = batch.env, batch.records
        self.env = env
        self.groups = [(name, tuple(ranks)) for name, ranks in env.groups]
        self.cols = {name: rec[name].tolist() for name in rec.dtype.names}
        self.chunks = batch.chunks.tolist()
        self.shapes = batch.shapes.tolist()

    def key(self, i: int) -> Key:
        gname, granks = self.groups[self.cols["group"][i]]
        return (self.env.run, gname, granks, self.cols["seq"][i])

    def is_entry(self, i: int) -> bool:
        return self.cols["phase"][i] == PHASE_ENTRY

    def meta(self, i: int) -> Meta:
        """What record ``i`` says of the call as its rank entered it."""
        env, s, cols, shapes = self.env, self.env.strings, self.cols, self.shapes
        in_at = cols["shape_off"][i]
        out_at = in_at + cols["in_ndim"][i]
        in_splits_at = out_at + cols["out_ndim"][i]
        out_splits_at = in_splits_at + cols["in_splits_n"][i]
        in_shape, out_shape = tuple(shapes[in_at:out_at]), tuple(shapes[out_at:in_splits_at])
        in_splits, out_splits = tuple(shapes[in_splits_at:out_splits_at]), \
            tuple(shapes[out_splits_at:out_splits_at + cols["out_splits_n"][i]])
        return Meta(env.rank, env.host, s[cols["op"][i]], s[cols["dtype"][i]],
                    cols["numel_in"][i], cols["numel_out"][i], in_shape, out_shape,
                    s[cols["redop"][i]], cols["root"][i], cols["peer"][i], in_splits,
                    out_splits, s[cols["callsite"][i]], cols["step"][i],
                    cols["t_enter"][i])

    def obs(self, i: int, meta: Meta) -> Obs:
        """What completion record ``i`` reports (``meta``: the same record's)."""
        env, s, cols = self.env, self.env.strings, self.cols
        off, n = cols["chunk_off"][i], cols["chunk_n"][i]
        return Obs(
            env.rank, env.host, meta.op, meta.dtype, meta.redop, meta.root,
            s[cols["algo"][i]], meta.callsite, cols["flags"][i], meta.numel_in,
            meta.numel_out, meta.step, cols["t_done"][i],
            (cols["in_h0"][i], cols["in_h1"][i]), (cols["out_h0"][i], cols["out_h1"][i]),
            cols["in_sum"][i], cols["in_absmax"][i], cols["in_nan"][i], cols["in_inf"][i],
            cols["out_sum"][i], cols["out_absmax"][i], cols["out_nan"][i],
            cols["out_inf"][i], tuple(self.chunks[off:off + n]),
        )


class Handoff(Protocol):
    """What the fast path may ask of the exact path (``exact.ExactPath`` implements it).

    Findings go into the ``findings`` list the fast path passes, in the order the
    sequential engine would have found them; the fast path calls in that order."""

    def is_open(self, key: Key) -> bool:
        """Whether the exact path holds ``key`` open."""

    def take_over(self, key: Key, open_key: OpenKey, findings: list[Finding]) -> None:
        """A fast row, converted, becomes an open key of the exact path. If every member
        entered and their agreement was not checked (``desync_checked``), check it now."""

    def record(self, rows: Rows, i: int, ticket: int, wid: int, books: Books,
               findings: list[Finding]) -> bool:
        """Record ``i`` of a batch, with its arrival ticket and the fast path's window;
        ``books`` hears of a member entering or completing. True when the record closed
        its key."""

    def close_if_complete(self, key: Key, findings: list[Finding]) -> bool:
        """Close the open ``key`` (and decide it, unless desynced) if every member
        completed it; True when it closed."""

    def decide(self, key: Key, complete: dict[int, Obs]) -> list[Finding]:
        """The findings of a collective every member completed (a converted fast row that
        failed a vectorised check; it never opens on the exact path)."""


class Pending:
    """An open key as the hang check sees it, from either path: who entered it, who
    completed it, and how to mark it reported. The members' Metas are built only when a
    report reads them (``entered``); ``t_first``/``t_last`` come without them."""

    __slots__ = ("born", "key", "ranks_in", "done", "desynced", "t_first", "t_last", "mark",
                 "_entered", "_make")

    def __init__(self, born: int, key: Key, ranks_in: Collection[int], done: Collection[int],
                 t_first: float, t_last: float, mark: Callable[[], None],
                 entered: dict[int, Meta] | None = None,
                 make: Callable[[], dict[int, Meta]] | None = None, desynced: bool = False):
        """``ranks_in``: the members that entered, ``done``: those that completed;
        ``t_first``/``t_last``: their earliest and latest t_enter; ``entered`` their Metas
        by rank in entry order, or ``make`` to build them."""
        self.born, self.key, self.ranks_in, self.done = born, key, ranks_in, done
        self.t_first, self.t_last, self.mark, self.desynced = t_first, t_last, mark, desynced
        self._entered, self._make = entered, make

    @classmethod
    def of(cls, key: Key, open_key: OpenKey) -> Pending:
        """An exact-path key (marked on the key itself)."""
        entered = open_key.entered
        times = [m.t_enter for m in entered.values()]

        def mark() -> None:
            open_key.hang_reported = True

        # min/max over the entry order, as the sequential engine always took them
        return cls(open_key.born, key, entered.keys(), open_key.complete.keys(),
                   min(times, default=0.0), max(times, default=0.0), mark, entered=entered,
                   desynced=open_key.desynced)

    @property
    def entered(self) -> dict[int, Meta]:
        if self._entered is None:
            self._entered = self._make()
            self._make = None
        return self._entered
