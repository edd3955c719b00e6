"""Real rings to damage: two ranks of one world, each ring written by the rank's own
writer (:class:`~commcheck.rank.ring.RingWriter`, the native one where it is built), left
behind unacknowledged as a rank whose relay never came leaves it; and reading a damaged
copy back as ``commcheck analyze`` does. Shared by the ring-damage tests and the ring
fuzzer."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from commcheck.rank.ring import RingWriter
from commcheck.rank.session import _Ready
from commcheck.relay.channel import Channel
from commcheck.wire import GOODBYE, Batch, decode
from commcheck.wire.relay_settings import RelaySettings
from commcheck.wire.ring import (
    ENTRY,
    HEADER_BYTES,
    R_RELEASED_OFF,
    W_WRITE,
    Identity,
    Ring,
    destination,
)
from commcheck.wire.salvage import Damage, leftover_messages, open_ring

from .records import rec

RUN = "damage"
RECORDS_PER_RANK = 208
ENTRIES = RECORDS_PER_RANK + 2  # hello, the records, goodbye: numbered 0 .. 209


@dataclass(frozen=True)
class Written:
    """One pristine ring file: its bytes and where each entry lies (data offsets)."""

    name: str
    raw: bytes
    spans: tuple[tuple[int, int], ...]  # entry number -> (offset, end of head + payload)

    def hit(self, lo: int, hi: int) -> list[int]:
        """The entries whose checksummed bytes (head and payload) meet data bytes
        ``lo``..``hi``: what damage there costs."""
        return [n for n, (a, b) in enumerate(self.spans) if a < hi and lo < b]

    def at(self, number: int) -> int:
        """File offset of entry ``number``."""
        return HEADER_BYTES + self.spans[number][0]


def write_rings(folder: Path) -> dict[int, Written]:
    """Ranks 0 and 1 of a two-rank world: hello, 208 all_reduce records, goodbye, nothing
    acknowledged (the rings stay)."""
    out = {}
    for rank in (0, 1):
        ident = Identity(run=RUN, rank=rank, host="h", world=2, node=-1, pid=os.getpid(),
                         dest=destination("", str(folder / "dump")))
        w = RingWriter.create(str(folder / "rings"), ident, 64 << 10)
        w.start()
        for i in range(RECORDS_PER_RANK):
            w.submit(_Ready(rec(seq=i, ranks=(0, 1), callsite="t.py:1 f", step=i)))
        path = w.path
        assert not w.close(linger=0)
        ring = Ring.open(path, writable=False)
        try:
            spans = tuple((e.off, e.off + ENTRY.size + len(e.payload))
                          for e in ring.entries(0, ring.word(W_WRITE)))
        finally:
            ring.close()
        assert len(spans) == ENTRIES
        out[rank] = Written(os.path.basename(path), Path(path).read_bytes(), spans)
    return out


def write_wrapped(folder: Path) -> tuple[bytes, int, int]:
    """A ring that went round several times, its relay (in this process, delivering to a
    dump file) gone after 400 records, 150 more and the goodbye left in it: its unread
    entries cross the end of the data area (a pad there) and older entries lie around
    them. Returns (bytes, start, end): the logical range only the ring holds."""
    ident = Identity(run=f"{RUN}-wrapped", rank=0, host="h", world=1, node=-1,
                     pid=os.getpid(), dest=destination("", str(folder / "dump")))
    w = RingWriter.create(str(folder / "wrapped"), ident, 64 << 10)
    w.start()
    settings = RelaySettings(batch_records=20, flush_interval=0.0, dump_dir=str(folder / "dump"))
    ch = Channel(Ring.open(w.path), settings, None)
    for first in range(0, 400, 100):
        for i in range(first, first + 100):
            w.submit(_Ready(rec(seq=i, ranks=(0,), callsite="x" * 150)))
        for _ in range(3):
            ch.poll(time.monotonic())
            ch.pump(time.monotonic())
    ch.close(remove=False)
    for i in range(400, 550):
        w.submit(_Ready(rec(seq=i, ranks=(0,), callsite="x" * 150)))
    path = w.path
    assert not w.close(linger=0)
    ring = Ring.open(path, writable=False)
    try:
        start, end = ring.word(R_RELEASED_OFF), ring.word(W_WRITE)
        assert end > 2 * ring.capacity and start // ring.capacity != end // ring.capacity
    finally:
        ring.close()
    return Path(path).read_bytes(), start, end


def put(path: Path, raw: bytes) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return path


def read_back(path: Path) -> tuple[Damage, list[Batch]]:
    """A ring file read as ``commcheck analyze`` reads it: what the damage cost and the
    messages (each must decode). Raises RingError for a file it refuses."""
    ring = open_ring(str(path))
    damage = Damage(str(path), faults=ring.faults)
    try:
        batches = [decode(p) for p in leftover_messages(ring, damage=damage)]
    finally:
        ring.close()
    return damage, batches


def seqs(batches: list[Batch]) -> list[int]:
    """The seqs of the records the messages carry, in order."""
    return [int(s) for b in batches for s in b.records["seq"]]


def said_goodbye(batches: list[Batch]) -> bool:
    return any(b.env.kind == GOODBYE for b in batches)
