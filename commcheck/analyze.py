"""Offline analysis: per-rank dump files in the wire format → the same engine and report.

The files of one run are merged in send-time order (each file already is), so the engine
sees batches in roughly the order a live collector would have. A damaged file costs only
its damaged tail: the frames before it are used and the damage is counted as a rejection.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from pathlib import Path

from .engine import Engine
from .engine.matcher import DEFAULT_HANG_TIMEOUT
from .pipeline import Pipeline
from .store import Store
from .wire import DUMP_MAGIC, Batch, WireError, decode, read_frames

DUMP_SUFFIX = ".ccw"


class AnalyzeError(Exception):
    pass


def find_dumps(root: str | Path) -> list[Path]:
    p = Path(root)
    if not p.exists():
        raise AnalyzeError(f"{root}: no such file or directory")
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(len(DUMP_MAGIC)) != DUMP_MAGIC:
                raise AnalyzeError(f"{root}: not a commcheck dump file")
        return [p]
    files = sorted(p.rglob(f"*{DUMP_SUFFIX}"))
    if not files:
        raise AnalyzeError(f"{root}: no commcheck dump files (*{DUMP_SUFFIX}) found")
    return files


def _batches(path: Path, on_error: Callable[[WireError], None],
             on_bytes: Callable[[int], None]) -> Iterator[tuple[float, int, Batch]]:
    """(send time, tie-breaker, batch) of each valid frame of one file."""
    with open(path, "rb") as f:
        frames = read_frames(f)
        n = 0
        while True:
            try:
                payload = next(frames)
            except StopIteration:
                return
            except WireError as e:
                on_error(WireError(e.reason, f"{path}: {e}"))
                return
            on_bytes(len(payload) + 4)
            try:
                batch = decode(payload)
            except WireError as e:
                on_error(e)
                continue
            n += 1
            yield batch.env.t, n, batch


def analyze(root: str | Path, store: Store, hang_timeout: float = DEFAULT_HANG_TIMEOUT,
            progress: Callable[[int], None] | None = None) -> Pipeline:
    """Feed every dump under ``root`` through a fresh engine into ``store``."""
    files = find_dumps(root)
    pipeline = Pipeline(Engine(0, hang_timeout), store)
    advance = progress or (lambda n: None)
    streams = [_batches(f, pipeline.reject, advance) for f in files]
    last_t = 0.0
    for t, _, batch in heapq.merge(*streams, key=lambda x: (x[0], x[1])):
        pipeline.feed_batch(batch)
        last_t = max(last_t, t)
    pipeline.close_run(last_t)
    pipeline.persist()
    return pipeline


def total_bytes(root: str | Path) -> int:
    return sum(f.stat().st_size for f in find_dumps(root))
