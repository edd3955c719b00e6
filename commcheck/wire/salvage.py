"""What a ring left behind, read when nothing vouches for it (``commcheck analyze``).

The file may be cut short, entries torn or overwritten, header words absurd. Damage costs
only the damaged entries: every entry carries its magic, its number and a crc32, so the
reader skips a damaged stretch to the next valid entry and knows from the numbers around
it how many entries it cost (:class:`Damage`). Header offsets are checked against each
other and the ring's size; every scan covers at most one ring's length of the file's real
bytes. docs/security.md has the reasoning.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import GOODBYE, HELLO, BatchBuilder, WireError, decode, encode
from .ring import (
    JOURNAL_SLOTS,
    K_GOODBYE,
    K_RECORD,
    R_ACKED_OFF,
    R_NEXT_SEQ,
    R_REJECTED,
    R_RELEASED_OFF,
    R_RELEASED_SEQ,
    STATE_GOODBYE,
    STATE_LEFT,
    W_ENTRIES,
    W_LAST,
    W_WRITE,
    Entry,
    Ring,
    RingError,
    builder_for,
    decode_record,
    message,
)

_SANE = 1 << 62  # an offset or seq past this is a damaged word, not a ring's history
_SHOWN = 3  # damaged stretches named in the line


@dataclass
class Damage:
    """What reading one ring found wrong: entries lost to damage (counted from the numbers
    around each damaged stretch), and header words it could not trust."""

    path: str
    read: int = 0  # valid entries read
    lost: int = 0  # entries lost to damage
    stretches: int = 0
    where: list[str] = field(default_factory=list)  # the first few stretches
    faults: list[str] = field(default_factory=list)

    def note(self, e: Entry) -> None:
        self.lost += e.lost
        self.stretches += 1
        if len(self.where) < _SHOWN:
            self.where.append(f"offset {e.off}: {e.error}, {e.lost} lost")

    def line(self) -> str:
        """One line for a person: the file, what the damage cost, where."""
        parts = []
        if self.stretches:
            more = ", ..." if self.stretches > len(self.where) else ""
            parts.append(f"{self.lost} damaged entries skipped, {self.read} read "
                         f"({'; '.join(self.where)}{more})")
        return f"{self.path}: " + "; ".join(parts + self.faults)


@dataclass(frozen=True)
class _Slot:
    start: int
    end: int
    seq: int
    t: float


def _window(ring: Ring, damage: Damage) -> tuple[int, int, int | None, int | None]:
    """Where the entries only the ring holds begin, the end the header vouches for, the
    number of the entry at the start and the entries written (None: the header cannot
    say). Offsets that do not fit together vouch for nothing: the start is then the first
    of them an entry agrees with, and the entries read to the last valid one."""
    cap = ring.capacity
    released, write = ring.word(R_RELEASED_OFF), ring.word(W_WRITE)
    written = ring.word(W_ENTRIES)
    acked = ring.word(R_ACKED_OFF)
    if released < acked <= write <= acked + cap < _SANE and _starts(ring, acked, write):
        # the relay acknowledges only what it released: one of the two words is damaged.
        # Behind the acknowledged offset lie entries already delivered (valid, from this
        # lap), which read again would reach the collector twice; past it, at worst
        # entries are lost, and said so.
        damage.faults.append(f"released offset {released} is behind the acknowledged "
                             f"{acked}: read from {acked}")
        released = acked
    if released <= write <= released + cap < _SANE:
        if not _starts(ring, released, write):
            damage.faults.append(f"released offset {released} is not where an entry starts: "
                                 f"read from the next valid entry")
        return released, write, 0 if released == 0 else None, written
    damage.faults.append(f"header offsets do not fit (released {released}, write {write}, "
                         f"ring of {cap} bytes): read to the last valid entry")
    for start in (released, write - cap, 0):
        if 0 <= start < _SANE:
            e = ring.entry_at(start, start + cap)
            if e is not None and not e.error:
                return start, start, 0 if start == 0 else None, None
    return 0, 0, 0, None


def _starts(ring: Ring, off: int, end: int) -> bool:
    """Whether an entry starts at ``off`` as far as can be told (the relay releases whole
    messages): aligned, and the ring's start or a valid entry (or nothing) there."""
    if off % 8:
        return False
    e = ring.entry_at(off, end)
    return off == 0 or e is None or not e.error or e.error == "cut short"


def _journal(ring: Ring, start: int, damage: Damage) -> tuple[list[_Slot], int]:
    """The journaled, unreleased messages (names for the entries in their ranges) and the
    seq the messages after them take. A slot that does not fit is left out: its entries
    are read all the same, under new names."""
    first, nxt = ring.word(R_RELEASED_SEQ), ring.word(R_NEXT_SEQ)
    if not first <= nxt <= first + JOURNAL_SLOTS < _SANE:
        damage.faults.append(f"journal words do not fit (released seq {first}, next seq "
                             f"{nxt}): messages named anew")
        return [], min(max(first, nxt), _SANE)
    slots, at, bad = [], start, []
    for seq in range(first, nxt):
        slot = ring.slot(seq)
        if slot is None or not at <= slot[1] <= slot[2] <= start + ring.capacity:
            bad.append(seq)
            continue
        slots.append(_Slot(slot[1], slot[2], seq, slot[3]))
        at = slot[2]
    if bad:
        damage.faults.append(f"{len(bad)} journal slots unreadable (message {bad[0]} the "
                             f"first): their entries named anew")
    return slots, nxt


def _entries(ring: Ring, damage: Damage) -> tuple[Iterator[Entry], list[_Slot], int]:
    start, vouched, first, written = _window(ring, damage)
    write = ring.word(W_WRITE)
    slots, seq = _journal(ring, start, damage)

    def read() -> Iterator[Entry]:
        prev = None if first is None else first - 1
        for e in ring.entries(start, vouched, first, written):
            if e.error:
                damage.note(e)
                continue
            damage.read += 1
            prev = e.number
            yield e
        # Past the end the header vouches for, only entries that carry the numbering on: a
        # rank that stopped before it published its last entry, or a write offset that lied
        # (older entries, from the lap before, never do).
        beyond = 0
        for e in ring.entries(vouched, start + ring.capacity,
                              None if prev is None else prev + 1):
            if e.error:
                if e.end >= start + ring.capacity:
                    break  # nothing valid follows: space never written
                damage.note(e)
                continue
            damage.read += 1
            beyond += 1
            yield e
        if beyond and vouched == write:
            damage.faults.append(f"{beyond} valid entries past the write offset {vouched} "
                                 f"read (the rank stopped before it said so?)")

    return read(), slots, seq


def leftover_messages(ring: Ring, batch_records: int = 512,
                      damage: Damage | None = None) -> Iterator[bytes]:
    """Every message a ring left behind still holds (for ``commcheck analyze``): the
    journaled, unreleased ones under their names, then the entries never sent, numbered on
    from ``next_seq`` as a relay would have. What was released but not acknowledged is in
    the relay's spill file, read separately. ``damage`` receives what the damage cost; the
    rank's counters in the messages count it as ``rejected_entries``."""
    damage = damage if damage is not None else Damage(ring.path)
    builder = builder_for(ring)
    entries, slots, seq = _entries(ring, damage)
    base = min(ring.word(R_REJECTED), _SANE)  # a counter, never past what a message holds

    def build(name: int, items: list[Entry], t: float) -> bytes:
        extra = {"rejected_entries": base + damage.lost}
        payload = message(ring, builder, name, items, t, extra)[0]
        damage.lost += extra.get("rejected", 0)  # checksummed, yet not a valid entry
        return payload

    batch: list[Entry] = []
    batch_slot: _Slot | None = None
    t, i, goodbye = 0.0, 0, False
    for e in entries:
        goodbye = goodbye or e.kind == K_GOODBYE
        while i < len(slots) and slots[i].end <= e.off:
            i += 1
        slot = slots[i] if i < len(slots) and slots[i].start <= e.off else None
        if batch and (slot is not batch_slot or e.kind != K_RECORD or
                      (slot is None and len(batch) >= batch_records)):
            yield build(batch_slot.seq if batch_slot else seq, batch,
                        batch_slot.t if batch_slot else t)
            seq += batch_slot is None
            batch, batch_slot, t = [], None, 0.0
        if e.kind != K_RECORD:
            yield build(slot.seq if slot else seq, [e], slot.t if slot else 0.0)
            seq += slot is None
            continue
        batch.append(e)
        batch_slot = slot
        with contextlib.suppress(RingError):
            r = decode_record(e.payload)
            t = max(t, r.t_done, r.t_enter)
    if batch:
        yield build(batch_slot.seq if batch_slot else seq, batch,
                    batch_slot.t if batch_slot else t)
        seq += batch_slot is None
    if damage.lost and not goodbye and ring.state() in (STATE_GOODBYE, STATE_LEFT):
        yield _goodbye(ring, builder, seq, base + damage.lost)


def _goodbye(ring: Ring, builder: BatchBuilder, seq: int, rejected: int) -> bytes:
    """The goodbye whose entry damage took, said as the header says it (the rank's state,
    its counters), as a relay says it from the same words: the rank's collectives its
    lost records leave open are then "not verified", not a missing rank."""
    counters = {**ring.counters(), "rejected_entries": rejected}
    t = ring.when(W_LAST)
    return encode(builder.control(GOODBYE, seq, t if math.isfinite(t) else 0.0,
                                  ring.identity.pid, counters=counters))


def open_ring(path: str, check_owner: bool = False) -> Ring:
    """A ring to read what it left behind, cut short or not (:meth:`Ring.open`
    ``salvage``); whatever its owner when the user named it, only the user's own
    (``check_owner``) when found in a directory. Its identity names every record it holds:
    one that no message could carry (rank outside its world, say) is refused. Raises
    RingError or OSError."""
    ring = Ring.open(path, writable=False, check_owner=check_owner, salvage=True)
    i = ring.identity
    try:
        decode(encode(builder_for(ring).control(HELLO, 0, 0.0, i.pid)))
    except (WireError, TypeError, ValueError, OverflowError) as e:
        ring.close()
        raise RingError(f"{path}: the header's identity is damaged (rank {i.rank}, world "
                        f"{i.world}, pid {i.pid}: {e})") from None
    return ring
