"""``commcheck analyze`` over several sources at once: a collector's database (what it
acknowledged), spill files (what the ranks kept when it never came back) and dump files,
overlapping. Every message is analysed exactly once, the overlaps are counted as the
rejection ``duplicate``, and the findings are those of the same messages in one clean dump.

Real parts: the collector's Store + Ledger write the database, the rank side's Spill writes
the spill file, and ``commcheck analyze`` runs through the CLI's ``main`` (and, end to end,
a torchrun job whose collector is killed with SIGKILL and never restarted)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import pytest

from commcheck.cli import main
from commcheck.collector.ledger import Ledger
from commcheck.collector.pipeline import Pipeline
from commcheck.collector.store import Store
from commcheck.engine import Engine
from commcheck.relay.spill import Spill, spill_path
from commcheck.wire import DUMP_MAGIC, GOODBYE, HELLO, BatchBuilder, encode, write_frame

from ..records import rec

pytestmark = pytest.mark.timeout(60)

RUN, WORLD, BATCHES, PER_BATCH = "merge", 3, 12, 2
BAD_RANK, BAD_SEQ = 2, 9  # rank 2's output of collective 9 differs: one value_mismatch


def _messages(rank: int) -> list[bytes]:
    """One rank's messages as its sender names them: hello (seq 0), BATCHES batches of
    PER_BATCH records, goodbye; every message carries the pid, send times increase."""
    b = BatchBuilder(RUN, rank, f"node{rank}", WORLD)
    pid, t0 = 4000 + rank, 1000.0 + rank * 0.001
    out = [encode(b.control(HELLO, 0, t0, pid))]
    for i in range(BATCHES):
        recs = []
        for c in range(i * PER_BATCH, (i + 1) * PER_BATCH):
            bad = rank == BAD_RANK and c == BAD_SEQ
            recs.append(rec(seq=c, ranks=tuple(range(WORLD)), out=(7, 7) if bad else (1, 1),
                            callsite=f"m.py:{c} main", step=c))
        env = b.build(recs, i + 1, t0 + i + 1)
        env.pid = pid
        out.append(encode(env))
    out.append(encode(b.control(GOODBYE, BATCHES + 1, t0 + BATCHES + 1, pid,
                                counters={"records": BATCHES * PER_BATCH})))
    return out


MSGS = {r: _messages(r) for r in range(WORLD)}
N_MSGS = sum(map(len, MSGS.values()))
N_RECORDS = WORLD * BATCHES * PER_BATCH


def _dump(path: Path, payloads: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(DUMP_MAGIC)
        for p in payloads:
            write_frame(f, p)


def _collector_db(path: Path, picks: dict[int, list[int]], bodies: bool = False) -> None:
    """A collector database holding ``picks`` (rank → message indices, each rank's a
    prefix, as a collector killed mid-run has), written as the collector does: names (and
    bodies with ``bodies``), records, findings and the engine's snapshot in one commit."""
    store = Store.create(path)
    ledger = Ledger(store.conn, bodies=bodies)
    pipeline = Pipeline(Engine(0), store)
    for rank, idx in picks.items():
        pipeline.feed_decoded(ledger.admit([(f"r{rank}".encode(), MSGS[rank][i])
                                            for i in idx]))
    pipeline.persist()
    assert ledger.delivered() == sum(map(len, picks.values()))
    store.close()


def _spill(spill_dir: Path, rank: int, idx: list[int]) -> Path:
    """A spill file as a rank leaves it, batches in the order given (not send order: the
    outbox is spilled at exit after the newer batches that overflowed it)."""
    s = Spill(spill_path(str(spill_dir), RUN, rank), 64 << 20)
    for i in idx:
        assert s.put(i, 4000 + rank, MSGS[rank][i], PER_BATCH)
    s.keep()
    return s.path


def _analyze(capsys, *args: str) -> tuple[int, dict, str]:
    rc = main(["analyze", *args, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if out.out.strip() else {}), out.err


def _key(f: dict) -> tuple:
    return (f["kind"], f["op"], f["group"], f["seq"], f["step"], tuple(f["culprits"]),
            f["ambiguous"])


def _stored(db: Path) -> tuple[int, int]:
    store = Store.open(db)
    conn = store.query()
    n = conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
    distinct = conn.execute("SELECT COUNT(*) FROM (SELECT DISTINCT run, rank, grp, seq, "
                            "t_done > 0 FROM records)").fetchone()[0]
    store.close()
    return n, distinct


IN_DB = {0: BATCHES + 2, 1: 7, 2: 5}  # per rank, how many messages the database holds


@pytest.fixture(params=["snapshot", "bodies"])
def sources(tmp_path, request) -> dict[str, Path]:
    """Rank 0: all in the DB. Rank 1: DB up to 7, spill 3..end (out of order). Rank 2: DB
    up to 4, spill 2..9, dump 8..end. Overlaps: rank 1 4 (3..6), rank 2 3 (2..4) + 2 (8, 9).
    The DB is continued from its snapshot, or (as a sharded collector's, whose K engines
    cannot be continued) read from the bodies --keep-bodies kept."""
    db = tmp_path / "collector.db"
    sharded = request.param == "bodies"
    _collector_db(db, {r: list(range(n)) for r, n in IN_DB.items()}, bodies=sharded)
    if sharded:  # the router's books and two shards' engines
        with sqlite3.connect(db) as conn:
            (part,) = conn.execute("SELECT body FROM snapshot").fetchone()
            conn.execute("DELETE FROM snapshot")
            conn.executemany("INSERT INTO snapshot VALUES (?, ?)", enumerate([part] * 3))
    last = BATCHES + 1
    spill_dir = tmp_path / "spill"
    _spill(spill_dir, 1, [*range(9, last + 1), *range(3, 9)])
    _spill(spill_dir, 2, list(range(2, 10)))
    ccw = tmp_path / "late" / "rank00002.ccw"
    _dump(ccw, MSGS[2][8:])
    clean = tmp_path / "clean"
    for r in range(WORLD):
        _dump(clean / RUN / f"rank{r:05d}.ccw", MSGS[r])
    return {"db": db, "spill": spill_dir, "ccw": ccw, "clean": clean, "sharded": sharded}


OVERLAPS = 4 + 3 + 2


def test_db_spill_and_dump_give_each_message_once(sources, tmp_path, capsys):
    rc, clean, err = _analyze(capsys, str(sources["clean"]), "--db", str(tmp_path / "c.db"))
    assert rc == 1, err
    assert clean["summary"]["rejected"] == {}
    assert clean["summary"]["records"] == N_RECORDS
    assert [f["kind"] for f in clean["findings"]] == ["value_mismatch"]
    assert clean["findings"][0]["culprits"] == [BAD_RANK]

    out = tmp_path / "merged.db"
    before = hashlib.sha256(sources["db"].read_bytes()).hexdigest()
    rc, merged, err = _analyze(capsys, str(sources["db"]), str(sources["spill"]),
                               str(sources["ccw"]), "--db", str(out))
    assert rc == 1, err
    s = merged["summary"]
    assert s["rejected"] == {"duplicate": OVERLAPS}
    assert s["records"] == N_RECORDS
    assert _stored(out) == (N_RECORDS, N_RECORDS)  # every record, exactly once
    assert s["verified"] == clean["summary"]["verified"] == BATCHES * PER_BATCH
    assert s["unmatched"] == 0 and s["ranks_said_goodbye"] == WORLD
    assert sorted(map(_key, merged["findings"])) == sorted(map(_key, clean["findings"]))
    assert hashlib.sha256(sources["db"].read_bytes()).hexdigest() == before  # read only


def test_each_source_alone_and_the_same_source_twice(sources, capsys):
    rc, doc, err = _analyze(capsys, str(sources["db"]))
    assert doc["summary"]["rejected"] == {}, err
    assert doc["summary"]["records"] == (BATCHES + 6 + 4) * PER_BATCH
    rc, doc, err = _analyze(capsys, str(sources["spill"]))
    assert doc["summary"]["rejected"] == {}, err
    assert doc["summary"]["records"] == (BATCHES - 2 + 8) * PER_BATCH
    # a directory and a file inside it: the file is read once, nothing counts as duplicate
    rc, doc, err = _analyze(capsys, str(sources["clean"]),
                            str(sources["clean"] / RUN / "rank00000.ccw"))
    assert doc["summary"]["rejected"] == {} and doc["summary"]["records"] == N_RECORDS, err
    # the same messages in two copies of a file: the second copy is all duplicates
    copy = sources["clean"].parent / "copy.ccw"
    copy.write_bytes((sources["clean"] / RUN / "rank00001.ccw").read_bytes())
    rc, doc, err = _analyze(capsys, str(sources["clean"]), str(copy))
    assert doc["summary"]["rejected"] == {"duplicate": len(MSGS[1])}, err
    assert doc["summary"]["records"] == N_RECORDS


def test_batches_reach_the_engine_in_send_time_order(sources, tmp_path, monkeypatch):
    """The spill files hold their batches out of order and the database in arrival order;
    the engine still gets every sender's messages in seq order, all of them by send time."""
    from commcheck.collector import analyze as mod

    fed: list[tuple[float, int, int]] = []
    real = mod.Pipeline.feed_batch

    def spy(self, batch):
        fed.append((batch.env.t, batch.env.rank, batch.env.seq))
        return real(self, batch)

    monkeypatch.setattr(mod.Pipeline, "feed_batch", spy)
    store = Store.create(tmp_path / "order.db")
    mod.analyze([sources["spill"], sources["ccw"], sources["db"]], store)
    store.close()
    skipped = {r: 0 if sources["sharded"] else n for r, n in IN_DB.items()}
    assert len(fed) == N_MSGS - sum(skipped.values())
    assert [t for t, _, _ in fed] == sorted(t for t, _, _ in fed)
    for r in range(WORLD):
        assert [seq for _, rank, seq in fed if rank == r] == list(range(skipped[r],
                                                                        len(MSGS[r])))


def test_spill_file_damage_costs_only_its_tail(sources, capsys):
    victim = next(sources["spill"].rglob("rank00002.*.spill"))
    victim.write_bytes(victim.read_bytes()[:-5])
    rc, doc, err = _analyze(capsys, str(sources["db"]), str(sources["spill"]),
                            str(sources["ccw"]))
    assert doc["summary"]["rejected"] == {"truncated": 1, "duplicate": OVERLAPS - 1}, err
    assert doc["summary"]["records"] == N_RECORDS  # the lost batch was also in the dump


def _one_error_line(err: str, rc: int, needle: str) -> None:
    lines = err.strip("\n").splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("commcheck: error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_bad_sources_are_one_line_errors(sources, tmp_path, capsys):
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE songs (title TEXT)")
    analysis = tmp_path / "analysis.db"  # an analyze output: a commcheck DB, no delivered
    assert main(["analyze", str(sources["clean"]), "--db", str(analysis)]) == 1
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"SQLite format 3\x00" + os.urandom(4000))
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    capsys.readouterr()
    cases = [
        ([str(sources["db"]), str(tmp_path / "nope")], "no such file or directory"),
        ([str(foreign)], "no delivered table"),
        ([str(analysis), str(sources["spill"])], "no delivered table"),
        ([str(junk)], "database"),
        ([str(text)], "not a commcheck dump file"),
        ([str(sources["db"]), "--db", str(sources["db"])], "is also an input"),
        ([str(sources["db"]), "--db", str(sources["db"].parent / "." / "collector.db")],
         "is also an input"),
    ]
    for args, needle in cases:
        rc, _, err = _analyze(capsys, *args)
        _one_error_line(err, rc, needle)


def test_databases_that_cannot_be_continued_are_one_line_errors(tmp_path, capsys):
    """Two databases to continue, one written by a sharded collector without
    --keep-bodies, one without a snapshot or bodies, a snapshot from another commcheck
    version, a damaged snapshot."""
    from commcheck.collector import snapshot

    def db(name: str, parts: list[bytes] | None = None) -> str:
        path = tmp_path / name
        _collector_db(path, {0: [0, 1]})
        if parts is not None:
            with sqlite3.connect(path) as conn:
                conn.execute("DELETE FROM snapshot")
                conn.executemany("INSERT INTO snapshot VALUES (?, ?)", enumerate(parts))
        return str(path)

    good = snapshot.dump(Engine(3))
    cases = [
        ([db("a.db"), db("b.db")], "two collector databases to continue"),
        ([db("sharded.db", [good, good, good])], "--shards 2"),  # no bodies kept
        ([db("nosnap.db", [])], "no engine snapshot"),
        ([db("old.db", [b"commcheck-snapshot 0 0.0.1\n" + good[40:]])], "0 0.0.1"),
        ([db("torn.db", [good[:-30]])], "damaged snapshot"),
    ]
    for args, needle in cases:
        rc, _, err = _analyze(capsys, *args, "--db", str(tmp_path / "out.db"))
        _one_error_line(err, rc, needle)


def test_corrupt_collector_db_is_one_line_and_leaves_no_output(tmp_path, capsys):
    db = tmp_path / "big.db"
    store = Store.create(db)
    ledger = Ledger(store.conn)
    for rank in range(WORLD):
        ledger.admit([(b"x", m) for m in MSGS[rank]])
    store.conn.executemany("INSERT INTO delivered VALUES (?,?,?,?,?)",
                           [("pad", 0, 1, i, os.urandom(300)) for i in range(2000)])
    store.close()
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'delivered'"
                            ).fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(db.read_bytes())
    data[(page - 1) * size:page * size] = os.urandom(size)
    db.write_bytes(bytes(data))
    out = tmp_path / "out.db"
    rc, _, err = _analyze(capsys, str(db), "--db", str(out))
    _one_error_line(err, rc, str(db))
    assert not out.exists()  # a rerun with the same --db is possible


# -- end to end: the collector is killed and never comes back ---------------------------------


def _delivered(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute("SELECT COUNT(*) FROM delivered").fetchone()[0]
    except sqlite3.Error:
        return 0
