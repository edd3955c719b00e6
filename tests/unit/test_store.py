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
                                                ("4", "written by a newer commcheck")])
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


def _batches(run: str = "job") -> list[bytes]:
    """Two ranks' batches: records with chunks, summaries and several groups."""
    from ..records import gathered, scattered

    out = []
    for r in range(2):
        b = BatchBuilder(run, r, f"node{r}", 2)
        out.append(encode(b.build([rec(seq=0, step=3, ranks=(0, 1)),
                                   gathered(r, {0: (1, 2), 1: (3, 4)}, {0: (1, 2), 1: (3, 4)},
                                            seq=1),
                                   scattered(r, [0.5, 1.5], 2.0, seq=2),
                                   rec(seq=0, group_name="tp", group_ranks=(r,))], seq=1)))
    return out


def _rows(store: Store) -> list[tuple]:
    return store.query().execute("SELECT * FROM records ORDER BY rank, grp, seq").fetchall()


@pytest.mark.parametrize("kept", ["file", "batches"])
def test_records_kept_by_the_default_store_read_back_as_the_rows_mode_stores_them(tmp_path,
                                                                                   kept):
    """The default (a records file) loses nothing: every column of every record, as the
    SQL rows of ``--records rows`` hold them, through Store.query and ``commcheck records``."""
    msgs = _batches()
    assert Store.create(tmp_path / "d.db").records == "file"
    stores = {}
    for mode in ("rows", kept):
        store = Store.create(tmp_path / f"{mode}.db", mode)
        for m in msgs:
            store.add_batch(decode(m), m)
        store.close()
        stores[mode] = Store.open(tmp_path / f"{mode}.db")
    assert stores[kept].conn.execute("SELECT COUNT(*) FROM main.records").fetchone()[0] == 0
    want = _rows(stores["rows"])
    assert len(want) == 8 and any(row[-1] for row in want)  # chunks kept
    assert _rows(stores[kept]) == want
    assert stores[kept].summary().records == 8 and stores[kept].summary().runs == ["job"]
    assert [b.env.rank for b in stores[kept].batches(rank=1)] == [1]
    assert stores[kept].query(rank=1).execute("SELECT DISTINCT rank FROM records"
                                              ).fetchall() == [(1,)]
    if kept == "file":
        assert list(stores["file"].frames()) == msgs  # the messages as received


def test_records_cli_queries_the_default_store(tmp_path, capsys):
    from commcheck.cli import main

    store = Store.create(tmp_path / "d.db")
    for m in _batches():
        store.add_batch(decode(m), m)
    store.close()
    assert main(["records", str(tmp_path / "d.db"), "--sql",
                 "SELECT rank, grp, seq, op FROM records WHERE seq = 2 ORDER BY rank"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rank\tgrp\tseq\top", "0\t0[0-3]\t2\treduce_scatter_single",
        "1\t0[0-3]\t2\treduce_scatter_single"]


def test_the_records_file_holds_what_was_committed_and_a_restart_cuts_the_rest(tmp_path):
    """Frames written after the last commit (never acknowledged: their senders send them
    again) are not read, and a collector continuing the database writes over them; a file
    that lost committed frames drops them from the index with a warning."""
    from commcheck.collector.store import records_path

    a, b = _batches(), _batches("job2")
    store = Store.create(tmp_path / "d.db")
    for m in a:
        store.add_batch(decode(m), m)
    store.commit()
    store.add_batch(decode(b[0]), b[0])
    store._writer.flush()  # written, as a killed collector leaves it, but never committed
    size = records_path(tmp_path / "d.db").stat().st_size
    store.abandon()  # as if killed: no commit, and its lock goes with it
    assert list(Store.open(tmp_path / "d.db").frames()) == a
    store = Store.create(tmp_path / "d.db")
    assert records_path(tmp_path / "d.db").stat().st_size < size
    store.add_batch(decode(b[1]), b[1])
    store.close()
    assert list(Store.open(tmp_path / "d.db").frames()) == [*a, b[1]]
    with open(records_path(tmp_path / "d.db"), "r+b") as f:  # the last frame lost
        f.truncate(records_path(tmp_path / "d.db").stat().st_size - 1)
    Store.create(tmp_path / "d.db").close()
    assert list(Store.open(tmp_path / "d.db").frames()) == a
    assert Store.open(tmp_path / "d.db").summary().records == 8


def test_a_schema_2_database_is_read_but_not_continued(tmp_path, capsys, monkeypatch):
    """Before the records file: report and analyze read it (its records are rows or
    batches); collect refuses it in one line rather than add a records file to it."""
    from commcheck.cli import main
    from commcheck.collector.store import StoreError

    monkeypatch.chdir(tmp_path)
    store = Store.create(tmp_path / "old.db", "rows")
    for m in _batches():
        store.add_batch(decode(m), m)
    store.conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema'")
    store.conn.execute("DROP TABLE record_frames")
    store.close()
    assert Store.open(tmp_path / "old.db").summary().records == 8
    assert len(_rows(Store.open(tmp_path / "old.db"))) == 8
    with pytest.raises(StoreError, match="written by an older commcheck"):
        Store.create(tmp_path / "old.db")
    assert main(["report", "old.db"]) == 0
    assert capsys.readouterr().out.startswith("commcheck report: 8 records")
    assert main(["collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "2", "--db",
                 "old.db", "--no-live", "--idle-timeout", "0.5"]) == 2
    assert capsys.readouterr().err.startswith("commcheck: error: old.db: written by an older")


def test_the_records_file_is_a_dump_file_analyze_reads(tmp_path, capsys):
    """Without its database too: the messages as received, in the wire format's frames."""
    from commcheck.cli import main
    from commcheck.collector.store import records_path

    store = Store.create(tmp_path / "d.db")
    for m in _batches():
        store.add_batch(decode(m), m)
    store.close()
    assert main(["analyze", str(records_path(tmp_path / "d.db")), "--json"]) == 3  # no goodbye
    assert '"records": 8' in capsys.readouterr().out
