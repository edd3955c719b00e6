"""A rank's spill file: batches that did not fit the outbox while the collector was away.

The file is a commcheck dump file (``DUMP_MAGIC`` then length-prefixed encoded envelopes),
so ``commcheck analyze`` can read one that a rank left behind. Batches are appended at the
end and taken back from a read offset (first in, first out) when the outbox has room
again; only the sender thread touches it. The file is bounded by ``max_bytes`` (beyond it
the caller drops, counted) and deleted at a clean exit once everything was delivered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import deque
from pathlib import Path

from ..wire import DUMP_MAGIC, write_frame

log = logging.getLogger("commcheck")


def spill_path(spill_dir: str, run: str, rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run) or "run"
    return Path(spill_dir) / safe / f"rank{rank:05d}.{os.getpid()}.spill"


class Spill:
    def __init__(self, path: Path, max_bytes: int):
        self.path = path
        self.max_bytes = max_bytes
        self._f = None
        self._size = 0
        # (seq, pid, records, offset, length) of each batch not yet taken back
        self._index: deque[tuple[int, int, int, int, int]] = deque()
        self.records = 0
        self.broken = False

    @property
    def pending(self) -> int:
        return len(self._index)

    def _open(self) -> bool:
        if self._f is None and not self.broken:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = open(self.path, "w+b")  # noqa: SIM115 - owned until discard()
                self._f.write(DUMP_MAGIC)
                self._size = len(DUMP_MAGIC)
            except OSError as e:
                self.broken = True
                log.warning("commcheck: cannot spill to %s: %s (dropping instead)",
                            self.path, e)
        return self._f is not None

    def put(self, seq: int, pid: int, payload: bytes, records: int) -> bool:
        if self._size + len(payload) + 4 > self.max_bytes or not self._open():
            return False
        try:
            self._f.seek(self._size)
            write_frame(self._f, payload)
        except OSError as e:
            log.warning("commcheck: spill write failed: %s", e)
            return False
        self._index.append((seq, pid, records, self._size + 4, len(payload)))
        self._size += len(payload) + 4
        self.records += records
        return True

    def peek(self) -> int | None:
        """Length of the next batch to take back, None if there is none."""
        return self._index[0][4] if self._index else None

    def take(self) -> tuple[int, int, bytes, int]:
        seq, pid, records, off, n = self._index.popleft()
        self._f.seek(off)
        payload = self._f.read(n)
        self.records -= records
        if not self._index:  # everything is back in memory: start the file over
            self._f.truncate(len(DUMP_MAGIC))
            self._size = len(DUMP_MAGIC)
        return seq, pid, payload, records

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
