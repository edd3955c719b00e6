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


def _other_version(path, schema: str) -> bytes:
    """A commcheck database as another version leaves it: schema 1 kept message bodies in
    ``delivered`` and (before engine snapshots) had no snapshot to restart from."""
    store = Store.create(path)
    store.conn.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (schema,))
    store.conn.execute("CREATE TABLE delivered (run TEXT, rank INTEGER, pid INTEGER, "
                       "seq INTEGER, body BLOB)")
    store.conn.execute("INSERT INTO delivered VALUES ('job', 0, 1, 0, x'00')")
    store.conn.execute("DROP TABLE snapshot")
    store.close()
    return path.read_bytes()


@pytest.mark.parametrize(("schema", "needle"), [("1", "written by an older commcheck"),
                                                ("3", "written by a newer commcheck")])
def test_a_database_of_another_schema_is_refused_in_one_line(tmp_path, capsys, monkeypatch,
                                                             schema, needle):
    """collect, report and analyze refuse it (exit 2, one line) and leave it as it was."""
    from commcheck.cli import main
    from commcheck.collector.store import StoreError

    monkeypatch.chdir(tmp_path)
    db = tmp_path / "old.db"
    before = _other_version(db, schema)
    for opener in (Store.create, Store.open):
        with pytest.raises(StoreError, match=needle):
            opener(db)
    for argv in (["collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "2", "--db",
                  "old.db", "--no-live", "--idle-timeout", "0.5"],
                 ["report", "old.db"], ["analyze", "old.db"]):
        rc = main(argv)
        lines = capsys.readouterr().err.strip("\n").splitlines()
        assert rc == 2 and len(lines) == 1, (argv, lines)
        assert lines[0].startswith("commcheck: error: old.db: " + needle), lines
    wal = tmp_path / "old.db-wal"  # readers of a WAL database may create an empty one
    assert db.read_bytes() == before and (not wal.exists() or wal.stat().st_size == 0)
