"""The collector's Prometheus endpoint (collect --metrics), in process: a real Collector
fed real wire messages, scraped over HTTP, parsed with prometheus_client's parser."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from commcheck.cli import main
from commcheck.collector.daemon import Collector, CollectorOptions
from commcheck.collector.metrics import MetricsError, parse_address
from commcheck.wire import BatchBuilder, encode

from ..records import rec

pytestmark = pytest.mark.timeout(60)


def test_addresses():
    assert parse_address("9400") == ("127.0.0.1", 9400)
    assert parse_address("0.0.0.0:9400") == ("0.0.0.0", 9400)
    assert parse_address("[::1]:0") == ("::1", 0)
    for bad in ("", "host:", "host:http", "70000", ":9400"):
        with pytest.raises(MetricsError):
            parse_address(bad)


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _messages(n_steps: int, bad_rank: int, bad_seq: int) -> list[tuple[bytes, bytes]]:
    now = time.time()
    out = []
    for rank in range(4):
        records = [rec(seq=i, out=(2, 2) if (rank, i) == (bad_rank, bad_seq) else (1, 1),
                       t_enter=now - 0.5, t_done=now - 0.4) for i in range(n_steps)]
        b = BatchBuilder("r", rank, f"node{rank // 2}", 4)
        out.append((f"relay{rank}".encode(), encode(b.build(records, seq=0))))
    return out


def test_counters_follow_the_collector(tmp_path):
    c = Collector(CollectorOptions(bind="tcp://127.0.0.1:*", world_size=4,
                                   db=str(tmp_path / "x.db"), metrics="127.0.0.1:0"))
    try:
        empty = _scrape(c.metrics.url)
        assert empty[("commcheck_records_total", ())] == 0
        assert empty[("commcheck_ranks", (("state", "connected"),))] == 0
        c.ingest(_messages(5, bad_rank=3, bad_seq=2))
        c.publish_metrics()
        m = _scrape(c.metrics.url)
    finally:
        c.metrics.close()
        c.receiver.close(linger=0)
        c.pipeline.stop()
        c.store.close()
    assert m[("commcheck_records_total", ())] == 20
    assert m[("commcheck_collectives_verified_total", ())] == 5
    assert m[("commcheck_findings_total", (("kind", "value_mismatch"),))] == 1
    assert m[("commcheck_world_size", ())] == 4
    assert m[("commcheck_ingest_lag_seconds_count", ())] == 4
    assert 0.4 <= m[("commcheck_ingest_lag_seconds_sum", ())] / 4 < 30
    assert m[("commcheck_ingest_lag_seconds_bucket", (("le", "0.25"),))] == 0


def test_metrics_port_in_use_is_one_line(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "1", "--db",
                   str(tmp_path / "x.db"), "--metrics", str(port), "--no-live"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("commcheck: error: --metrics"), lines


def test_bad_metrics_address_is_one_line(tmp_path, capsys):
    rc = main(["collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "1", "--db",
               str(tmp_path / "x.db"), "--metrics", "nowhere:port", "--no-live"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "HOST:PORT" in lines[0], lines
