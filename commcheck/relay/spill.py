"""A rank's spill file, kept by the relay: messages that did not fit the outbox while the
collector was away.

The file is a commcheck dump file (``DUMP_MAGIC`` then length-prefixed encoded envelopes),
so ``commcheck analyze`` can read one left behind. Messages are appended at the end (and
flushed at once: once a message is here the relay frees its records in the rank's ring, so
a relay killed a moment later must find it) and taken back first in, first out when the
outbox has room again. A message stays in the file until the collector acknowledged it;
once every message in it is acknowledged the file starts over. A restarted relay reopens
the file (:meth:`Spill.load`) and re-sends what it holds. Bounded by ``max_bytes`` (beyond
it the caller keeps the records in the ring instead); deleted once everything in it was
delivered. Private to the user (0600).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from pathlib import Path

from ..wire import DUMP_MAGIC, REC_DTYPE, WireError, decode, read_frames, write_frame
from ..wire.private import NotPrivate, open_mine
from .folders import run_dir_name

log = logging.getLogger("commcheck")


def spill_path(spill_dir: str, run: str, rank: int, pid: int | None = None) -> Path:
    """``DIR/RUN/rankNNNNN.PID.spill``; ``pid`` is the rank's (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return Path(spill_dir) / run_dir_name(run) / f"rank{rank:05d}.{pid}.spill"


class Spill:
    def __init__(self, path: Path, max_bytes: int):
        self.path = path
        self.max_bytes = max_bytes
        self._f = None
        self._size = 0
        # (seq, pid, records, offset, length) of each message not yet taken back
        self._index: deque[tuple[int, int, int, int, int]] = deque()
        self._unacked: set[tuple[int, int]] = set()  # (pid, seq) of every message in here
        self.records = 0
        self.broken = False

    @property
    def pending(self) -> int:
        """Messages not yet taken back."""
        return len(self._index)

    @property
    def held(self) -> int:
        """Messages in the file the collector has not acknowledged (taken back or not)."""
        return len(self._unacked)

    def __contains__(self, name: tuple[int, int]) -> bool:
        return name in self._unacked

    def _open(self) -> bool:
        if self._f is None and not self.broken:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = open_mine(self.path, os.O_RDWR | os.O_CREAT)
                self._f = os.fdopen(fd, "w+b")
                self._f.truncate(0)
                self._f.write(DUMP_MAGIC)
                self._f.flush()
                self._size = len(DUMP_MAGIC)
            except (OSError, NotPrivate) as e:
                self.broken = True
                log.warning("commcheck: cannot spill to %s: %s (keeping records in the ring "
                            "instead)", self.path, e)
        return self._f is not None

    def load(self) -> int:
        """Reopen a spill file a previous relay left (all its messages pending again; a
        torn last frame is cut off). Returns the messages found."""
        if not self.path.exists():
            return 0
        try:
            fd = open_mine(self.path, os.O_RDWR)  # never frames someone else could have put there
            f = os.fdopen(fd, "r+b")
        except (OSError, NotPrivate) as e:
            log.warning("commcheck: cannot reopen the spill file %s: %s", self.path, e)
            return 0
        good = len(DUMP_MAGIC)
        try:
            for payload in read_frames(f):
                off = good + 4
                good = off + len(payload)
                try:
                    env = decode(payload).env
                except WireError:
                    continue
                n = len(env.records) // REC_DTYPE.itemsize
                self._index.append((env.seq, env.pid, n, off, len(payload)))
                self._unacked.add((env.pid, env.seq))
                self.records += n
        except WireError:
            pass  # bad magic (nothing usable) or a torn tail: keep what came before
        if good == len(DUMP_MAGIC) and not self._index:
            f.seek(0)
            f.write(DUMP_MAGIC)
        f.truncate(good)
        self._f, self._size = f, good
        return len(self._index)

    def put(self, seq: int, pid: int, payload: bytes, records: int,
            pending: bool = True) -> bool:
        """Append a message; ``pending=False``: only a durable copy of one the outbox holds
        (it is not taken back, but kept until acknowledged)."""
        if self._size + len(payload) + 4 > self.max_bytes or not self._open():
            return False
        try:
            self._f.seek(self._size)
            write_frame(self._f, payload)
            self._f.flush()
        except OSError as e:
            log.warning("commcheck: spill write failed: %s", e)
            with contextlib.suppress(OSError):
                self._f.truncate(self._size)
            return False
        if pending:
            self._index.append((seq, pid, records, self._size + 4, len(payload)))
            self.records += records
        self._unacked.add((pid, seq))
        self._size += len(payload) + 4
        return True

    def peek(self) -> int | None:
        """Length of the next message to take back, None if there is none."""
        return self._index[0][4] if self._index else None

    def take(self) -> tuple[int, int, bytes, int]:
        """The oldest message not yet taken back; it stays in the file until acked."""
        seq, pid, records, off, n = self._index.popleft()
        self._f.seek(off)
        payload = self._f.read(n)
        self.records -= records
        return seq, pid, payload, records

    def acked(self, names: list[tuple[int, int]]) -> None:
        """The collector acknowledged these (pid, seq): once nothing in the file waits for
        an ack, the file starts over."""
        for name in names:
            self._unacked.discard(tuple(name))  # type: ignore[arg-type]
        if self._f is not None and not self._unacked and not self._index and \
                self._size > len(DUMP_MAGIC):
            self._f.truncate(len(DUMP_MAGIC))
            self._f.flush()
            self._size = len(DUMP_MAGIC)

    def discard(self) -> None:
        """Everything was delivered: remove the file."""
        if self._f is not None:
            self._f.close()
            self._f = None
        with contextlib.suppress(OSError):
            self.path.unlink()

    def keep(self) -> None:
        if self._f is not None:
            self._f.flush()
            self._f.close()
            self._f = None
