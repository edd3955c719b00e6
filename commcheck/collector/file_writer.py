"""The records file's writes, on a thread of their own.

Appending each message to the records file (``collect``'s default storage) is a kernel copy
of every byte into the page cache: ~7 % of the collector's ingest thread at 2 M records/s'
worth of messages (docs/ingest.md). ``os.writev`` releases the GIL, so a writer thread does
that copy on another core while the ingest thread decides the next block. Frames keep
their order (one thread, one queue); :meth:`flush` returns once every frame handed over is
in the file, and the store calls it before a commit names them (store.py). A failed write
is raised by every later call of the store's thread (nothing is written after it); the
frames written before it are still indexed.
"""

from __future__ import annotations

import os
import queue
import threading

MAX_QUEUED = 256  # messages waiting (~30 MiB of the bench's): beyond, the caller waits


def writev_all(fd: int, bufs: list) -> None:
    """Write ``bufs`` at the file's position, in order (one writev, resumed after a short
    write)."""
    views = [memoryview(b) for b in bufs]
    while views:
        done = os.writev(fd, views)
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


class WriteFailed(OSError):
    def __init__(self, written: int, error: OSError):
        super().__init__(error.errno, error.strerror)
        self.written = written


class FileWriter:
    """Appends buffers to ``fd`` on its own thread, in the order given."""

    def __init__(self, fd: int):
        self.fd = fd
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._error: OSError | None = None
        self.written_since_flush = 0  # of the items handed over since the last flush
        self._thread = threading.Thread(target=self._run, name="commcheck-records-file",
                                        daemon=True)
        self._thread.start()

    def write(self, bufs: list) -> None:
        if self._error is not None:  # the store's next commit says what was written
            raise WriteFailed(0, self._error)
        self._queue.put(bufs)

    def flush(self) -> None:
        """Wait until everything handed over is in the file. A failed write raises
        :class:`WriteFailed`, saying how many of the items handed over since the last flush
        were written before it."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        written, self.written_since_flush = self.written_since_flush, 0
        if self._error is not None:  # for good: the frames after it would be misplaced
            raise WriteFailed(written, self._error) from self._error

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.stop()

    def stop(self) -> None:
        """End the thread, with or without what is queued being written."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
            elif self._error is None:  # after a failure, nothing more: the file ends there
                try:
                    writev_all(self.fd, item)
                    self.written_since_flush += 1
                except OSError as e:
                    self._error = e
