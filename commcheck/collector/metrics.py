"""Prometheus metrics of a running collector: ``commcheck collect --metrics HOST:PORT``.

The collector's loop owns every count; it hands this module an immutable :class:`Snapshot`
a few times a second (and once more after its last commit), and the HTTP thread of
``prometheus_client`` turns the latest one into metric families on each scrape. The two
threads share one reference, replaced whole, so a scrape never sees half an update and the
loop never waits for a scrape. Only the ingest-lag histogram is observed directly (its
buckets have their own lock).

Metric names (all prefixed ``commcheck_``): ``records_total``,
``collectives_verified_total``, ``findings_total{kind}``, ``ranks{state}`` (connected,
goodbye, silent), ``world_size``, ``rejected_messages_total{reason}``,
``rank_records_spilled_total``, ``rank_records_dropped_total``, ``ingest_lag_seconds``,
``rank_wait_seconds_total{rank,host}`` and ``rank_last_arrivals_total{rank,host}`` (who the
others waited for, docs/stragglers.md).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from ..engine.stragglers import rank_rows
from ..wire import Decoded, WireError

if TYPE_CHECKING:
    from ..engine import Finding
    from ..engine.state import RankState
    from .store import Store

PUBLISH_INTERVAL = 0.25  # seconds between snapshots while the collector runs
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class MetricsError(Exception):
    """A --metrics address that cannot be parsed or bound."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or a bare ``PORT`` (loopback: metrics are off the
    network unless asked)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    host = host.strip("[]")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 0 <= number <= 65535:
        raise MetricsError(f"--metrics {text}: expected HOST:PORT or PORT")
    return host, number


@dataclass(frozen=True)
class Snapshot:
    """What one scrape shows."""

    records: int = 0
    verified: int = 0
    world: int = 0
    findings: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("connected", "goodbye", "silent"), 0))
    rejected: dict[str, int] = field(default_factory=dict)
    spilled: int = 0
    dropped: int = 0
    # per rank: (host, seconds waiting in collectives, collectives it arrived last in)
    lateness: dict[int, tuple[str, float, int]] = field(default_factory=dict)


class Metrics:
    """The exporter of one collector; :meth:`collect` is called by prometheus_client."""

    def __init__(self, address: str, store: Store, silent_after: float):
        host, port = parse_address(address)
        self.silent_after = silent_after
        self.snapshot = Snapshot()
        self.findings: Counter[str] = Counter(dict(store.conn.execute(
            "SELECT kind, COUNT(*) FROM findings GROUP BY kind")))  # a restart keeps them
        self._heard: dict[int, float] = {}  # rank -> monotonic time of its last message
        self._started = self._published = time.monotonic()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.lag = Histogram(
            "commcheck_ingest_lag_seconds", "Per batch: seconds from the creation of its "
            "oldest record to the engine's verdicts on it", buckets=LAG_BUCKETS,
            registry=self.registry)
        self.registry.register(self)
        try:
            self.server, self._thread = start_http_server(port, host, self.registry)
        except OSError as e:
            raise MetricsError(f"--metrics {address}: cannot serve on {host}:{port}: "
                               f"{e.strerror or e}") from None
        self.url = f"http://{host}:{self.server.server_port}/metrics"

    def finding(self, f: Finding) -> None:
        self.findings[f.kind] += 1

    def ingested(self, items: Iterable[Decoded], now: float | None = None) -> None:
        """Decoded messages the engine just took: who was heard, and each batch's lag."""
        wall = time.time() if now is None else now
        mono = time.monotonic()
        for _, batch in items:
            if isinstance(batch, WireError):
                continue
            self._heard[batch.env.rank] = mono
            r = batch.records
            if len(r):
                created = np.maximum(np.maximum(r["t_enter"], r["t_exit"]), r["t_done"])
                self.lag.observe(max(0.0, wall - float(created.min())))

    def due(self) -> bool:
        """Whether a new snapshot is due (at most one every PUBLISH_INTERVAL s)."""
        return time.monotonic() - self._published >= PUBLISH_INTERVAL

    def publish(self, counters: dict[str, int], ranks: dict[int, RankState],
                world_size: int, rejected: dict[str, int]) -> None:
        """A new snapshot of the collector's counts: its counters, the engine's ranks, the
        world it expects and the messages it rejected, by reason."""
        mono = time.monotonic()
        self._published = mono
        world = int(counters.get("world") or world_size)
        quiet_since = mono - self.silent_after
        silent = sum(1 for rank, s in ranks.items() if not s.goodbye
                     and self._heard.get(rank, self._started) < quiet_since)
        if self._started < quiet_since:
            silent += max(0, world - len(ranks))
        self.snapshot = Snapshot(
            records=int(counters.get("records", 0)), verified=int(counters.get("verified", 0)),
            world=world, findings=dict(self.findings),
            ranks={"connected": sum(s.hello and not s.goodbye for s in ranks.values()),
                   "goodbye": sum(s.goodbye for s in ranks.values()), "silent": silent},
            rejected=dict(rejected),
            spilled=sum(s.counters.get("spilled", 0) for s in ranks.values()),
            dropped=sum(s.counters.get("dropped", 0) for s in ranks.values()),
            lateness={r: (ranks[r].host if r in ranks else "", f.get("wait_us", 0) / 1e6,
                          f.get("last", 0)) for r, f in rank_rows(counters).items()})

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        yield CounterMetricFamily("commcheck_records", "Records received and checked",
                                  value=s.records)
        yield CounterMetricFamily("commcheck_collectives_verified",
                                  "Collectives every member reported, and checked",
                                  value=s.verified)
        findings = CounterMetricFamily("commcheck_findings", "Findings, by kind",
                                       labels=["kind"])
        for kind, n in sorted(s.findings.items()):
            findings.add_metric([kind], n)
        yield findings
        ranks = GaugeMetricFamily(
            "commcheck_ranks", "Ranks: connected (said hello, no goodbye yet), goodbye "
            "(ended normally), silent (no goodbye and nothing heard for --hang-timeout s)",
            labels=["state"])
        for state, n in s.ranks.items():
            ranks.add_metric([state], n)
        yield ranks
        yield GaugeMetricFamily("commcheck_world_size", "Ranks in the job", value=s.world)
        rejected = CounterMetricFamily("commcheck_rejected_messages",
                                       "Messages refused, by reason", labels=["reason"])
        for reason, n in sorted(s.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield CounterMetricFamily("commcheck_rank_records_spilled",
                                  "Records the ranks' relays spilled to disk, as reported",
                                  value=s.spilled)
        yield CounterMetricFamily("commcheck_rank_records_dropped",
                                  "Records the ranks dropped (full ring or queue), as reported",
                                  value=s.dropped)
        yield from _lateness(s)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _lateness(s: Snapshot) -> Iterator[Metric]:
    wait = CounterMetricFamily("commcheck_rank_wait_seconds", "Seconds each rank waited in "
                               "completed collectives (for the last arrival, and the "
                               "transfer)", labels=["rank", "host"])
    last = CounterMetricFamily("commcheck_rank_last_arrivals", "Completed collectives each "
                               "rank arrived last in (the others waited for it)",
                               labels=["rank", "host"])
    for rank, (host, seconds, n) in sorted(s.lateness.items()):
        wait.add_metric([str(rank), host], seconds)
        last.add_metric([str(rank), host], n)
    yield wait
    yield last
