"""Dropped is never missing: what ranks said they dropped, and the collectives it leaves
unverified.

A rank whose ring was full drops records and says which (``Envelope.drops``: seq ranges
per group and phase). A collective lacking a member's entry or completion is then not
that member's fault: the stall checks (``stalls.py``) ask :meth:`Dropped.excuse` before
they report a ``missing_rank`` or a ``hang``, and count the collective here as "not
verified: records dropped on rank r" instead. Collectives every member dropped never reach
the engine at all; they are counted from the ranges alone.

Counted as not verified: every (run, group, seq) whose completion some rank dropped (the
union over ranks: one collective counts once), plus each open collective the stall checks
excused for another reason (only the entry dropped and nothing completed, or the rank's
later records in the group arrived). Per rank: the collectives its own drops left
unverified.
"""

from __future__ import annotations

from bisect import bisect_right

from ..wire import PHASE_COMPLETE, DropRange
from .model import Key

GroupId = tuple[str, str, tuple[int, ...]]  # run, group name, group ranks

DROPPED, LATER, LOST = "dropped", "later", "lost"  # why a member's absence is excused


class Intervals:
    """Disjoint, sorted, inclusive integer ranges; merging on insert."""

    __slots__ = ("lo", "hi")

    def __init__(self) -> None:
        self.lo: list[int] = []
        self.hi: list[int] = []

    def add(self, first: int, last: int) -> int:
        """Insert ``first..last``; returns how many integers were new."""
        lo, hi = self.lo, self.hi
        i = bisect_right(hi, first - 2)  # the first range that may touch or overlap
        j = i
        while j < len(lo) and lo[j] <= last + 1:
            first, last = min(first, lo[j]), max(last, hi[j])
            j += 1
        new = last - first + 1 - sum(b - a + 1 for a, b in zip(lo[i:j], hi[i:j], strict=True))
        del lo[i:j], hi[i:j]
        lo.insert(i, first)
        hi.insert(i, last)
        return new

    def __contains__(self, x: int) -> bool:
        i = bisect_right(self.lo, x) - 1
        return i >= 0 and self.hi[i] >= x

    def __len__(self) -> int:
        return sum(h - lo + 1 for lo, h in zip(self.lo, self.hi, strict=True))


class Dropped:
    """The drop ranges ranks reported, and the collectives left unverified."""

    def __init__(self) -> None:
        # (run, group name, group ranks, rank, phase) -> seqs that rank dropped
        self.ranges: dict[tuple, Intervals] = {}
        # (run, group name, group ranks) -> seqs some rank dropped the completion of
        self.unverified: dict[GroupId, Intervals] = {}
        self.excused = 0  # open collectives excused outside ``unverified``
        self.by_rank: dict[int, int] = {}  # collectives left unverified by each rank's drops
        # of ``excused``, those whose records were lost (damaged in a ring, rejected), not
        # dropped: no rank said it dropped them; and the same per rank
        self.excused_lost = 0
        self.lost_by_rank: dict[int, int] = {}

    def __setstate__(self, state: dict) -> None:
        """A snapshot from before records lost were told from records dropped."""
        self.__dict__.update({"excused_lost": 0, "lost_by_rank": {}, **state})

    def note(self, run: str, rank: int, drops: list[DropRange]) -> None:
        for d in drops:
            granks = tuple(d.ranks)
            mine = self.ranges.setdefault((run, d.group, granks, rank, d.phase), Intervals())
            new = mine.add(d.first, d.last)
            if d.phase == PHASE_COMPLETE and new:
                self.by_rank[rank] = self.by_rank.get(rank, 0) + new
                self.unverified.setdefault((run, d.group, granks), Intervals()).add(
                    d.first, d.last)

    def dropped(self, key: Key, rank: int, phase: int) -> bool:
        """Whether ``rank`` said it dropped its record of ``phase`` for ``key``."""
        run, gname, granks, seq = key
        mine = self.ranges.get((run, gname, granks, rank, phase))
        return mine is not None and seq in mine

    def count(self, key: Key, ranks: list[int], lost: tuple[int, ...] | list[int] = ()
              ) -> None:
        """``key`` stays unverified because of ``ranks``' missing records: count it once.
        ``lost``: those of ``ranks`` that never said they dropped them (damaged, rejected)."""
        run, gname, granks, seq = key
        union = self.unverified.get((run, gname, granks))
        if union is not None and seq in union:
            return
        self.excused += 1
        if all(r in lost for r in ranks):
            self.excused_lost += 1
        for r in ranks:
            book = self.lost_by_rank if r in lost else self.by_rank
            book[r] = book.get(r, 0) + 1

    @property
    def not_verified(self) -> int:
        return self.excused + sum(len(iv) for iv in self.unverified.values())

    def counters(self) -> dict[str, int]:
        """As the collector stores them: ``not_verified`` and ``not_verified.<rank>``
        (omitted while nothing was dropped, so databases stay as before)."""
        if not self.by_rank and not self.excused:
            return {}
        out = {"not_verified": self.not_verified}
        out.update({f"not_verified.{r}": n for r, n in sorted(self.by_rank.items())})
        if self.excused_lost:
            out["not_verified_lost"] = self.excused_lost
            out.update({f"not_verified_lost.{r}": n for r, n in sorted(self.lost_by_rank.items())})
        return out
