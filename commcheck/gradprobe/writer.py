"""Background thread that turns computed step statistics into msprobe-layout files.

The training thread only enqueues; all formatting and disk I/O happen here. The queue is
bounded: when it is full a step is dropped and counted (or, with ``block_when_full``, the
training thread waits), never silently lost. The thread is a daemon, so the writer is
drained at exit and on SIGTERM/SIGINT (:mod:`.drain`); while it runs, a marker file in the
rank directory says so, and a run that finds one left by a dead process (SIGKILL) says that
the steps it had queued may be missing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from commcheck.gradprobe import drain, layout
from commcheck.gradprobe.buffers import DirectionSlot, HostBuffer
from commcheck.gradprobe.stats import StepStats

log = logging.getLogger("commcheck.gradprobe")
DIRECT_MIN_BYTES = 1 << 20
QUEUE_LIMIT = 256
MARKER = ".gradprobe-writing"  # in the rank directory while a writer runs


@dataclass
class StepJob:
    """Everything the writer needs for one ``(rank, step)``."""

    rank_path: str
    step: int
    level: str
    bounds: tuple[float, ...]
    stats: StepStats
    slot: DirectionSlot | None
    packed: bool
    release: Callable[[DirectionSlot], None] | None = None


@dataclass
class WriterCounters:
    steps_written: int = 0
    steps_dropped: int = 0
    errors: int = 0
    direct_io: bool = True
    first_error: str | None = field(default=None)
    # What a writer that ended without draining left here (its marker), else None.
    unclean_previous: str | None = field(default=None)


def csv_rows(job: StepJob, table: np.ndarray, hashes: list[str] | None) -> list[list[object]]:
    """Rows of ``grad_summary_{step}.csv`` with msprobe's cell types (so ``csv`` formats alike)."""
    plan = job.stats.plan
    rows: list[list[object]] = [layout.csv_header(job.level, job.bounds)]
    for i, name in enumerate(plan.names):
        numel = plan.numels[i]
        row: list[object] = [name]
        if hashes is not None:
            row.append(hashes[i])
        if plan.counts:
            row += _fractions([int(round(c)) for c in table[i, 3:]], numel)
        row += [float(v) for v in table[i, :3]]
        row.append(layout.format_shape(plan.shapes[i]))
        rows.append(row)
    return rows


def _fractions(counts: list[int], numel: int) -> list[float | int]:
    """Interval fractions from ``count(x <= b_i)`` and ``count(x != 0)``, as msprobe divides."""
    *le, nonzero = counts
    intervals = [le[0]] + [b - a for a, b in zip(le, le[1:], strict=False)] + [numel - le[-1]]
    intervals.append(numel - nonzero)
    return [c / numel if numel else 0 for c in intervals]


class DumpWriter:
    """Owns the writer thread; ``stop()`` drains the queue and joins. ``rank_path``: where
    the marker goes (None: no marker)."""

    def __init__(self, block_when_full: bool, rank_path: str | None = None) -> None:
        self._queue: queue.Queue[StepJob | None] = queue.Queue(QUEUE_LIMIT)
        self._block = block_when_full
        self.counters = WriterCounters()
        self._marker = os.path.join(rank_path, MARKER) if rank_path else None
        self._claim()
        self._thread = threading.Thread(target=self._run, name="gradprobe-writer", daemon=True)
        self._thread.start()
        drain.register(self)

    def _claim(self) -> None:
        """Say (once) what a previous writer that never drained may have lost; mark ours."""
        if self._marker is None:
            return
        try:
            with open(self._marker) as fh:
                left = fh.read().strip()
        except FileNotFoundError:
            left = None
        except OSError:
            left = ""
        if left is not None and not _alive(left):
            self.counters.unclean_previous = left or "?"
            log.warning(
                "gradprobe: a previous writer in %s (%s) ended without draining (killed by "
                "SIGKILL or the like): the steps it still had queued may be missing there",
                os.path.dirname(self._marker), left or "unknown process")
        try:
            with open(self._marker, "w") as fh:
                fh.write(f"pid={os.getpid()} host={socket.gethostname()} "
                         f"started={time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        except OSError as exc:
            log.info("gradprobe: cannot write %s: %s", self._marker, exc)
            self._marker = None

    def submit(self, job: StepJob) -> bool:
        try:
            self._queue.put(job, block=self._block)
            return True
        except queue.Full:
            self.counters.steps_dropped += 1
            if job.slot is not None and job.release is not None:
                job.release(job.slot)
            return False

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def flush(self) -> None:
        """Wait until every submitted step is written (never call from the hook)."""
        if self._thread.is_alive():
            self._queue.join()

    def wait_idle(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` s, until every submitted step is written; takes no lock
        (a signal handler may have interrupted a thread holding the queue's)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._thread.is_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def stop(self, timeout: float | None = None) -> bool:
        """Write what is queued, end the thread, remove the marker; False if the thread was
        still busy after ``timeout`` s (the marker then stays)."""
        drain.unregister(self)
        if self._thread.is_alive():
            if self._thread is threading.current_thread():
                return False
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return False
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        if self._marker is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._marker)
            self._marker = None
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                self._write(job)
                self.counters.steps_written += 1
            except Exception as exc:
                self.counters.errors += 1
                if self.counters.first_error is None:
                    self.counters.first_error = f"{type(exc).__name__}: {exc}"
                    log.error("gradprobe: writing step %d failed: %s", job.step, exc)
            finally:
                if job.slot is not None and job.release is not None:
                    job.release(job.slot)
                self._queue.task_done()

    def _write(self, job: StepJob) -> None:
        table, hashes = job.stats.ready()
        os.makedirs(job.rank_path, exist_ok=True)
        if job.slot is not None:
            step_path = layout.step_dir(job.rank_path, job.step)
            os.makedirs(step_path, exist_ok=True)
            for name, buf in zip(job.stats.plan.names, job.slot.buffers, strict=True):
                self._write_npy(layout.direction_path(step_path, name), buf)
                if job.packed:
                    bits = np.packbits(buf.tensor.numpy().reshape(-1).view(np.uint8))
                    with open(layout.packed_path(step_path, name), "wb") as fh:
                        np.save(fh, bits)
        path = layout.summary_csv_path(job.rank_path, job.step)
        layout.write_csv(path, csv_rows(job, table, hashes))

    def _write_npy(self, path: str, buf: HostBuffer) -> None:
        region = buf.region()
        if self.counters.direct_io and buf.aligned and buf.nbytes >= DIRECT_MIN_BYTES:
            if _write_direct(path, region, buf.nbytes):
                return
            self.counters.direct_io = False
            log.info("gradprobe: O_DIRECT unsupported under %s; using buffered writes", path)
        with open(path, "wb") as fh:
            fh.write(region[: buf.nbytes])


def _alive(marker: str) -> bool:
    """Whether the writer that left ``marker`` (its text) is still running on this host."""
    fields = dict(part.partition("=")[::2] for part in marker.split())
    if fields.get("host") != socket.gethostname():
        return False
    try:
        pid = int(fields.get("pid", ""))
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _write_direct(path: str, region: memoryview, nbytes: int) -> bool:
    """Write a page-aligned region with ``O_DIRECT`` and trim the file; False if unsupported."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        done = 0
        while done < len(region):
            done += os.write(fd, region[done:])
        os.ftruncate(fd, nbytes)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
