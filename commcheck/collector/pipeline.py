"""Bytes in, findings stored: the path shared by the live collector and offline analysis.

Decode (rejecting and counting bad input per reason), feed the engine, persist records,
findings and the engine's snapshot, and hand each new finding to a callback. Whoever owns a
Pipeline owns the clock: the collector calls :meth:`check_hangs` with wall time, the
analyzer with dump time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..engine import Engine, Finding
from ..wire import Batch, Decoded, WireError, decode, try_decode
from . import snapshot
from .store import Store


class Pipeline:
    def __init__(self, engine: Engine, store: Store,
                 on_finding: Callable[[Finding], None] | None = None,
                 on_reject: Callable[[WireError], None] | None = None):
        self.engine = engine
        self.store = store
        self.on_finding = on_finding
        self.on_reject = on_reject
        self.rejected: Counter[str] = Counter()
        self.first: Finding | None = None
        self._fed = True  # the engine changed since the last snapshot

    def feed(self, data: bytes) -> list[Finding]:
        try:
            batch = decode(data)
        except WireError as e:
            self.reject(e)
            return []
        return self.feed_batch(batch)

    def feed_batch(self, batch: Batch) -> list[Finding]:
        self._fed = True
        findings = self.engine.ingest(batch)
        self.store.add_batch(batch)
        self.emit(findings)
        return findings

    def feed_many(self, messages: list[bytes]) -> list[Finding]:
        """Several messages at once: the engine decides their records as one block (the
        same findings as feeding them one by one, far fewer numpy calls per record)."""
        return self.feed_decoded([(data, try_decode(data)) for data in messages])

    def feed_decoded(self, items: list[Decoded]) -> list[Finding]:
        """:meth:`feed_many` for messages decoded already (by the collector's ledger)."""
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
        """Continue from the engine state committed before a restart (:meth:`persist`);
        this run's world size and hang timeout replace the snapshot's.
        Raises :class:`~commcheck.snapshot.SnapshotError`."""
        if len(parts) != 1:  # a router's and K shards'
            raise snapshot.SnapshotError(f"the database holds the state of {len(parts) - 1} "
                                         f"engines; run with --shards {len(parts) - 1}")
        engine = snapshot.load(parts[0])
        if self.engine.world_size:
            engine.world_size = engine.stats.world = self.engine.world_size
        engine.hang_timeout = self.engine.hang_timeout
        self.engine = engine

    def reject(self, e: WireError) -> None:
        self.rejected[e.reason] += 1
        if self.on_reject is not None:
            self.on_reject(e)

    def emit(self, findings: list[Finding]) -> None:
        if not findings:
            return
        self._fed = True
        self.store.add_findings(findings)
        if self.first is None:
            self.first = findings[0]
        if self.on_finding is not None:
            for f in findings:
                self.on_finding(f)

    def check_hangs(self, now: float) -> None:
        self.emit(self.engine.check_hangs(now))

    def close_run(self, now: float) -> None:
        """Once every rank said goodbye, a collective still missing members is a hang for
        sure; otherwise only those past the timeout are."""
        self._fed = True
        self.emit(self.engine.finish() if self.engine.done else self.engine.check_hangs(now))

    def counters(self) -> dict[str, int]:
        st = self.engine.stats
        out = {"records": st.records, "verified": st.verified, "findings": st.findings,
               "unmatched": self.engine.unmatched(), "nan_folded": st.nan_folded,
               "evicted": st.evicted, "late": st.late}
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
        if self._fed:
            self.store.set_snapshot(self.snapshot_parts())
            self._fed = False
        self.store.commit()

    def snapshot_parts(self) -> list[bytes]:
        return [snapshot.dump(self.engine)]
