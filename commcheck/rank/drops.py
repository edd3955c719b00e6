"""Which records a rank dropped, so the collector can tell dropped from missing.

A full ring drops a record (counted); a count alone lets the collector only guess which
collectives lack a member because of it, and it guessed ``missing_rank``. The book keeps
the dropped records as seq ranges per (group, phase) until the rank can write them to its
ring (a ``K_DROPS`` entry, see :mod:`commcheck.wire.ring`), which the relay sends as the
``drops`` of a records message. Bounded: beyond ``MAX_RANGES`` open ranges a group's last
range is stretched over the new seq (it then names a few seqs that were not dropped, which
the engine marks "not verified" too: never a false blame).
"""

from __future__ import annotations

from ..wire import Record

MAX_RANGES = 1024

RangeKey = tuple[str, tuple[int, ...], int]  # group name, group ranks, phase


class DropBook:
    """Dropped records not yet reported, as ranges; :meth:`take` hands them out."""

    __slots__ = ("_ranges", "n")

    def __init__(self) -> None:
        self._ranges: dict[RangeKey, list[list[int]]] = {}
        self.n = 0  # ranges held: the writer tests this plain attribute for every record

    def __bool__(self) -> bool:
        return self.n > 0

    def note(self, r: Record) -> None:
        """``r`` was dropped."""
        self.note_key(r.group_name, r.group_ranks, r.phase, r.seq)

    def note_key(self, group: str, ranks: tuple[int, ...], phase: int, seq: int) -> None:
        """The record of (``group``, ``ranks``) ``phase`` ``seq`` was dropped."""
        key = (group, tuple(ranks), int(phase))
        seq = int(seq)
        ranges = self._ranges.get(key)
        if ranges is None:
            self._ranges[key] = [[seq, seq]]
            self.n += 1
            return
        last = ranges[-1]
        if last[0] - 1 <= seq <= last[1] + 1 or self.n >= MAX_RANGES:
            last[0], last[1] = min(last[0], seq), max(last[1], seq)
            return
        ranges.append([seq, seq])
        self.n += 1

    def take(self) -> list[tuple[str, tuple[int, ...], int, int, int]]:
        """The ranges noted since the last call, as ``encode_drops`` wants them."""
        out = [(g, ranks, phase, lo, hi) for (g, ranks, phase), ranges in self._ranges.items()
               for lo, hi in ranges]
        self._ranges.clear()
        self.n = 0
        return out

    def put_back(self, ranges: list[tuple[str, tuple[int, ...], int, int, int]]) -> None:
        """Ranges :meth:`take` gave out that could not be written: keep them."""
        for g, ranks, phase, lo, hi in ranges:
            self._ranges.setdefault((g, ranks, phase), []).append([lo, hi])
            self.n += 1
