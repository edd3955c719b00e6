"""The resolver thread: records whose device fingerprints are still on their way wait here
in order, and this one thread writes each once its event fired, so the training thread
never waits for device work. The same thread runs the rank's periodic duties (a relay is
there, the stop-signal mark is in front), so a rank has one helper thread, not several."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from ..wire import Record

RESOLVE_POLL = 0.002  # seconds between polls of pending device fingerprints
IDLE_WAIT = 1.0  # seconds the thread sleeps with nothing pending and no duty sooner


class Pending(Protocol):
    """Something that becomes a Record once its device work finished."""

    def ready(self) -> bool: ...

    def finalize(self) -> Record: ...


class Duty:
    """Something the thread does every ``interval`` seconds, first after ``first``."""

    def __init__(self, run: Callable[[], None], interval: float, first: float = 0.0):
        self.run, self.interval, self.first = run, interval, first


class Resolver:
    """Pending records in submission order, written by :meth:`resolve`; ``write`` writes
    one, ``error`` counts a failure, ``lost`` drops (and counts) those never resolved."""

    def __init__(self, write: Callable[[Record], object],
                 error: Callable[[BaseException], None],
                 lost: Callable[[Iterable[Pending]], None], duties: Iterable[Duty] = ()):
        self._write, self._error, self._lost = write, error, lost
        self._duties = list(duties)
        self._idle = min([IDLE_WAIT, *(d.interval for d in self._duties)])
        self._pending: deque[Pending] = deque()
        self._resolving = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commcheck-resolver",
                                        daemon=True)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, item: Pending) -> None:
        self._pending.append(item)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def forget(self) -> None:
        """In a forked child: the parent's pending work is not this process's to write."""
        self._pending = deque()

    def resolve(self, deadline: float | None = None, wait: bool = True,
                last: bool = False) -> None:
        """Write pending records whose device work finished, in order; with a deadline,
        wait for them until then; ``last``: then drop (and count) what is still pending.
        One thread at a time (the resolver thread, or the one closing the ring), never
        blocking the resolver thread (``wait=False``)."""
        if not self._resolving.acquire(blocking=wait):
            return
        try:
            while self._pending:
                head = self._pending[0]
                try:
                    if not head.ready():
                        if deadline is None or time.monotonic() > deadline:
                            break
                        time.sleep(0.001)
                        continue
                    self._write(head.finalize())
                except Exception as e:
                    self._error(e)
                self._pending.popleft()
            if last and self._pending:
                self._lost(list(self._pending))
                self._pending.clear()
        finally:
            self._resolving.release()

    def _run(self) -> None:
        start = time.monotonic()
        due = [start + d.first for d in self._duties]
        while not self._stop.is_set():
            self.resolve(wait=False)
            now = time.monotonic()
            for i, duty in enumerate(self._duties):
                if now >= due[i]:
                    due[i] = now + duty.interval
                    duty.run()
            self._wake.wait(RESOLVE_POLL if self._pending else self._idle)
            self._wake.clear()
