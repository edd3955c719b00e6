"""The Grafana board (deploy/grafana/commcheck.json) queries only what the exporter serves:
every metric and label its PromQL names is in a live scrape of a real collector's
``--metrics`` endpoint (fed a mismatch and a malformed message, so every family has
samples)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from commcheck.collector.daemon import Collector, CollectorOptions

from .test_metrics import _messages, _scrape

pytestmark = pytest.mark.timeout(60)

BOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "commcheck.json"
# Labels Prometheus or PromQL add, not the exporter: the scrape target, the histogram's
# bucket bound.
NOT_EXPORTED = {"instance", "le"}


def _queries(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return exprs


def _labels(expr: str) -> set[str]:
    """Label names a query selects or groups by."""
    by = {x.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr)
          for x in group.split(",")}
    matched = set(re.findall(r"[{,]\s*([a-z_]+)\s*[=!]~?", expr))
    return (by | matched) - NOT_EXPORTED


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    db = tmp_path_factory.mktemp("grafana") / "x.db"
    c = Collector(CollectorOptions(bind="tcp://127.0.0.1:*", world_size=4, db=str(db),
                                   metrics="127.0.0.1:0"))
    try:
        c.ingest([*_messages(5, bad_rank=3, bad_seq=2), (b"relay9", b"\x93not a message")])
        c.publish_metrics()
        yield _scrape(c.metrics.url)
    finally:
        c.metrics.close()
        c.receiver.close(linger=0)
        c.pipeline.stop()
        c.store.close()


def test_board_loads_and_every_panel_queries():
    board = json.loads(BOARD.read_text())
    assert board["uid"] == "commcheck" and board["panels"]
    for p in board["panels"]:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_every_queried_metric_is_served(scrape):
    served = {name for name, _ in scrape}
    labels: dict[str, set[str]] = {}
    for name, pairs in scrape:
        labels.setdefault(name, set()).update(k for k, _ in pairs)
    queried = set()
    for expr in _queries(json.loads(BOARD.read_text())):
        names = set(re.findall(r"\bcommcheck_[a-z_]+", expr))
        assert names, f"a query names no commcheck metric: {expr}"
        queried |= names
        for label in _labels(expr):
            assert any(label in labels.get(n, ()) for n in names), \
                f"{expr}: label {label!r} is not on {sorted(names)}"
    missing = queried - served
    assert not missing, f"the board queries metrics the exporter does not serve: {missing}"
    # what the issue asks the board to show, each queried
    assert {"commcheck_records_total", "commcheck_collectives_verified_total",
            "commcheck_findings_total", "commcheck_ranks",
            "commcheck_rank_records_dropped_total", "commcheck_rank_records_spilled_total",
            "commcheck_ingest_lag_seconds_bucket"} <= queried


def test_a_wrong_name_would_be_caught(scrape):
    """The check is not vacuous: a metric the exporter does not serve is not in the scrape."""
    served = {name for name, _ in scrape}
    assert "commcheck_records_total" in served
    assert "commcheck_records_per_second" not in served
    rejected = [dict(pairs) for n, pairs in scrape if n == "commcheck_rejected_messages_total"]
    assert rejected and all("reason" in r for r in rejected)
