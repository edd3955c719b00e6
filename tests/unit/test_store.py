"""The SQLite store mirrors the engine: one row per rank, findings round-trip."""

from __future__ import annotations

import pytest

from commcheck.collector.store import Store
from commcheck.engine import Engine
from commcheck.wire import GOODBYE, HELLO, BatchBuilder, decode, encode

from ..records import feed_all, rec

pytestmark = pytest.mark.timeout(30)


def test_a_restarted_rank_is_one_row_under_its_new_run(tmp_path):
    store = Store.create(tmp_path / "s.db")
    engine = Engine(2)
    for run in ("job", "job#restart1"):
        for r in (0, 1):
            engine.ingest(decode(encode(BatchBuilder(run, r, "h", 2).control(HELLO, 0))))
        store.set_ranks(engine.ranks)
    engine.ingest(decode(encode(BatchBuilder("job#restart1", 0, "h", 2).control(GOODBYE, 1))))
    store.set_ranks(engine.ranks)
    store.commit()
    ranks = Store.open(tmp_path / "s.db").summary().ranks
    assert [(r.run, r.rank, r.goodbye) for r in ranks] == [
        ("job#restart1", 0, True), ("job#restart1", 1, False)]


def test_findings_round_trip_with_their_detail(tmp_path):
    _, findings = feed_all({r: [rec(out=(9, 9) if r == 1 else (1, 1))] for r in range(4)})
    store = Store.create(tmp_path / "s.db")
    store.add_findings(findings)
    store.close()
    [f] = Store.open(tmp_path / "s.db").findings()
    assert f == findings[0]
