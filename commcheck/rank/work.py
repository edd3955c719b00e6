"""A Work that finishes the record when the collective completes, without forcing a wait.

``wait()`` calls the real wait and then fingerprints the output on the caller's thread
before returning, so a user who mutates the output right after ``wait()`` cannot race the
hash. ``get_future()`` returns the real future chained with the same finishing step.
Everything else is delegated to the real Work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist


class TrackedWork(dist.Work):
    def __init__(self, inner: dist.Work, finish: Callable[[], None],
                 failed: Callable[[BaseException], None] | None = None):
        super().__init__()
        self._inner = inner
        self._finish = finish
        self._failed = failed  # told what the real wait raised; guarded by its owner
        self._lock = threading.Lock()
        self._done = False

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._finish()

    def wait(self, *args, **kwargs):
        try:
            result = self._inner.wait(*args, **kwargs)
        except Exception as e:
            if self._failed is not None:
                self._failed(e)
            raise
        self._complete()
        return result

    def get_future(self):
        def finished(fut):
            self._complete()
            return fut.value()

        return self._inner.get_future().then(finished)

    def is_completed(self):
        return self._inner.is_completed()

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def source_rank(self):
        return self._inner.source_rank()

    def _source_rank(self):
        return self._inner._source_rank()

    def result(self):
        return self._inner.result()

    def synchronize(self):
        return self._inner.synchronize()

    def block_current_stream(self):
        return self._inner.block_current_stream()

    def get_future_result(self):
        return self._inner.get_future_result()

    def _get_op_type(self):
        return self._inner._get_op_type()

    def _get_duration(self):
        return self._inner._get_duration()

    def boxed(self):
        return self._inner.boxed()

    def finish_if_completed(self) -> None:
        """Called at shutdown for works the user never waited on."""
        if not self._done and self._inner.is_completed():
            self._complete()


class DoneWork(dist.Work):
    """What a skipped async call returns (``skip`` fault): a Work that already succeeded."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def get_future(self):
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([])
        return fut
