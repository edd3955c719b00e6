"""Bytes in, findings stored: the path shared by the live collector and offline analysis.

Decode (rejecting and counting bad input per reason), feed the engine, persist records,
findings and the engine's snapshot, and hand each new finding to a callback. Whoever owns a
Pipeline owns the clock: the collector calls :meth:`check_hangs` with wall time, the
analyzer with dump time.

:class:`PipelineBase` is what every driver shares and decides nothing; :class:`Pipeline`
runs one engine in this process, ``shards.ShardedPipeline`` K engines in shard processes.
The sharded one keeps an engine too, for the rank books only: it derives from the base, not
from :class:`Pipeline`, so no method that feeds or asks an engine for verdicts can reach
its books by inheritance.
"""

from __future__ import annotations

import ctypes
import gc
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable

from ..engine import Engine, Finding, Kind, Liveness
from ..wire import Batch, Decoded, WireError, try_decode
from . import snapshot
from .store import Store

# The cyclic GC's generation-0 threshold in an ingesting process (default 700): each
# message brings a few container objects (envelope, group lists), so at the default the
# collector ran ~240 collections per 2 M records, ~5 % of the ingest CPU; nothing it keeps
# needs cycles freed early.
GC_THRESHOLD = (50_000, 20, 10)
# glibc malloc: blocks up to 32 MiB from the heap, and up to 256 MiB of freed heap kept
# rather than given back. By default every freed block of messages, block columns or
# snapshot (~0.1-30 MiB) went back to the OS and its next use faulted every page in again,
# zeroed: writing 437 MiB of messages 8 MiB at a time cost 0.6-2.0 s of CPU that way, 0.15 s
# with the heap kept (the shared 2-core box).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_TRIM_BYTES, MALLOC_MMAP_BYTES = 256 << 20, 32 << 20


def tune_process() -> None:
    """Fewer GC passes and no memory churn with the OS, in a process that ingests (the
    collector, its shards); not for a library's host process."""
    gc.set_threshold(*GC_THRESHOLD)
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES)
    except (OSError, AttributeError):  # not glibc: its allocator's defaults stay
        pass


class PipelineBase(ABC):
    """Rejection counts, storing and handing on findings; the drivers do the rest."""

    def __init__(self, engine: Engine, store: Store,
                 on_finding: Callable[[Finding], None] | None = None,
                 on_reject: Callable[[WireError], None] | None = None):
        self.engine = engine
        self.store = store
        self.on_finding = on_finding
        self.on_reject = on_reject
        self.rejected: Counter[str] = Counter()
        self.first: Finding | None = None
        self._fed = True  # the engine(s) changed since the last snapshot

    def feed(self, data: bytes) -> list[Finding]:
        return self.feed_decoded([(data, try_decode(data))])

    def feed_many(self, messages: list[bytes]) -> list[Finding]:
        """Several messages at once: the engine decides their records as one block (the
        same findings as feeding them one by one, far fewer numpy calls per record)."""
        return self.feed_decoded([(data, try_decode(data)) for data in messages])

    @abstractmethod
    def feed_decoded(self, items: list[Decoded]) -> list[Finding]:
        """:meth:`feed_many` for messages decoded already (by the collector's ledger)."""

    @abstractmethod
    def resume(self, parts: list[bytes]) -> None:
        """Continue from the engine state(s) committed before a restart (:meth:`persist`).
        Raises :class:`~commcheck.collector.snapshot.SnapshotError`."""

    @abstractmethod
    def check_hangs(self, now: float) -> None: ...

    @abstractmethod
    def observe(self, rank: int, liveness: Liveness, now: float) -> None:
        """What a relay sees of ``rank``'s process (``Engine.observe``)."""

    @abstractmethod
    def close_run(self, now: float) -> None:
        """Once every rank said goodbye, a collective still missing members is a hang for
        sure; otherwise only those past the timeout are."""

    @abstractmethod
    def counters(self) -> dict[str, int]: ...

    @abstractmethod
    def persist(self) -> None:
        """Ranks, counters, onset details and (when something was fed) the snapshot, in
        one transaction."""

    @abstractmethod
    def stop(self) -> None: ...

    def reject(self, e: WireError) -> None:
        self.rejected[e.reason] += 1
        if self.on_reject is not None:
            self.on_reject(e)

    def emit(self, findings: list[Finding]) -> None:
        if not findings:
            return
        self._fed = True
        self.store.add_findings(findings)
        if self.first is None:  # a straggler slows a run, it does not diverge
            self.first = next((f for f in findings if f.kind is not Kind.STRAGGLER), None)
        if self.on_finding is not None:
            for f in findings:
                self.on_finding(f)

    def _load(self, part: bytes) -> Engine:
        """An engine from a snapshot, with this run's world size and hang timeout."""
        engine = snapshot.load(part)
        if self.engine.world_size:
            engine.world_size = engine.stats.world = self.engine.world_size
        engine.hang_timeout = self.engine.hang_timeout
        return engine


class Pipeline(PipelineBase):
    """One engine, in this process."""

    def feed_batch(self, batch: Batch) -> list[Finding]:
        self._fed = True
        findings = self.engine.ingest(batch)
        self.store.add_batch(batch)
        self.emit(findings)
        return findings

    def feed_decoded(self, items: list[Decoded]) -> list[Finding]:
        batches, raws = [], []
        for data, batch in items:
            if isinstance(batch, WireError):
                self.reject(batch)
            else:
                batches.append(batch)
                raws.append(data)
        self._fed = True
        findings = self.engine.ingest_many(batches)
        for batch, raw in zip(batches, raws, strict=True):
            self.store.add_batch(batch, raw)
        self.emit(findings)
        return findings

    def resume(self, parts: list[bytes]) -> None:
        """This run's world size and hang timeout replace the snapshot's."""
        if len(parts) != 1:  # a router's and K shards'
            raise snapshot.SnapshotError(f"the database holds the state of {len(parts) - 1} "
                                         f"engines; run with --shards {len(parts) - 1}")
        self.engine = self._load(parts[0])

    def check_hangs(self, now: float) -> None:
        self.emit(self.engine.check_hangs(now))

    def observe(self, rank: int, liveness: Liveness, now: float) -> None:
        self.engine.observe(rank, liveness, now)

    def close_run(self, now: float) -> None:
        self._fed = True
        self.emit(self.engine.finish() if self.engine.done else self.engine.check_hangs(now))

    def counters(self) -> dict[str, int]:
        st = self.engine.stats
        out = {"world": self.engine.world_size,
               "records": st.records, "verified": st.verified, "findings": st.findings,
               "unmatched": self.engine.unmatched(), "nan_folded": st.nan_folded,
               "evicted": st.evicted, "late": st.late, **st.op_counters()}
        out.update(self.engine.dropped.counters())
        out.update(self.engine.lateness.counters())
        out.update(self.engine.stalls.counters())
        out.update({f"rejected.{k}": v for k, v in self.rejected.items()})
        return out

    def stop(self) -> None:
        """Nothing to stop: the engine runs in this process (see shards.py for one that
        does not)."""

    def persist(self) -> None:
        self.store.set_ranks(self.engine.ranks)
        self.store.set_counters(self.counters())
        for onset in self.engine.onsets.values():
            self.store.update_finding_detail(onset.finding)
        for death in {id(f): f for f in self.engine.deaths.values()}.values():
            self.store.update_finding_detail(death)  # later consequences and waits counted
        for episode in self.engine.stragglers.take_changed():
            self.store.update_finding_detail(episode)  # its cost so far, its end
        if self._fed:
            self.store.set_snapshot([snapshot.dump(self.engine)])
            self._fed = False
        self.store.commit()
