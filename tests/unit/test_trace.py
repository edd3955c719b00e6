"""``commcheck trace``: a database (written through the real collector path, tests/demo_runs.py)
as Chrome trace-event JSON: a track per rank under its host, one slice per recorded call
(the report's per-op counts), the findings as instant events on the culprits' tracks, calls
never completed left open; streamed, whatever the records mode."""

from __future__ import annotations

import io
import json
import os
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from commcheck.cli import main
from commcheck.collector.calls import Steps
from commcheck.collector.report import load
from commcheck.collector.store import Store
from commcheck.collector.trace import write_trace
from commcheck.wire import PHASE_ENTRY, BatchBuilder, Record, encode

from ..demo_runs import BAD_STEP, CULPRIT, HOST, T0, W4, demo, demo_dump, died
from ..traces import by as _by
from ..traces import rank as _rank
from ..traces import tracks as _tracks
from ..traces import well_formed as _well_formed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def dbs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("trace")
    return {"demo": demo(d / "demo.db"), "demo_rows": demo(d / "demo_rows.db", "rows"),
            "demo_batches": demo(d / "demo_batches.db", "batches"),
            "died": died(d / "died.db"), "died_rows": died(d / "died_rows.db", "rows")}


def _trace(db: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{db.stem}.json"
    assert main(["trace", str(db), "-o", str(out), *extra]) == 0
    assert os.stat(out).st_mode & 0o777 == 0o600
    return json.loads(out.read_text())


def test_demo_trace(dbs, tmp_path, capsys):
    doc = _trace(dbs["demo"], tmp_path)
    line = capsys.readouterr().err.strip()
    assert line.endswith("156 calls (0 never completed), 2 findings, 4 ranks on 2 hosts, "
                         "all steps"), line
    events = doc["traceEvents"]
    _well_formed(events)
    procs, threads = _tracks(events)
    assert sorted(procs.values()) == ["node0", "node1"]
    assert {threads[(pid, r)]: procs[pid] for pid, r in threads} == \
        {f"rank {r}": HOST[r] for r in W4}  # one track per rank, under its host
    slices = _by(events, "X")
    _, summary = load(Store.open(dbs["demo"]))
    assert Counter(e["name"] for e in slices) == {o.op: o.recorded for o in summary.ops}
    assert Counter(_rank(e) for e in slices) == dict.fromkeys(W4, 39)
    s = next(e for e in slices if _rank(e) == 1 and e["args"]["step"] == 10
             and e["name"] == "all_gather")
    assert s["args"] | {"callsite": None} == {
        "group": "0[0-3]", "seq": 15, "step": 10, "bytes_in": 4096, "bytes_out": 16384,
        "dtype": "float32", "callsite": None}
    assert s["args"]["callsite"] == "train_demo.py:60 train_step"
    assert s["ts"] == pytest.approx((T0 + 1.06 + 0.001) * 1e6) and s["dur"] > 0
    assert not _by(events, "B") and not _by(events, "E")
    instants = {e["name"].split(":")[0]: e for e in _by(events, "i")}
    assert set(instants) == {"value_mismatch", "link_corruption"}
    bad = instants["value_mismatch"]  # the injected flip, on rank 2's track under node1
    assert (_rank(bad), procs[bad["pid"]], bad["s"]) == (CULPRIT, "node1", "t")
    assert bad["args"]["step"] == BAD_STEP and bad["args"]["culprits"] == [CULPRIT]
    assert bad["args"]["text"].startswith("value_mismatch (injected): sum differs by 2.5")
    assert _rank(instants["link_corruption"]) == 3
    assert instants["link_corruption"]["args"]["text"].endswith("links 1→3")


def test_every_finding_kind_is_marked(tmp_path):
    """The stored every-kind database: one instant per culprit of each finding, and the
    reduction wrong on every rank (no culprit) on a track of its own, scoped global."""
    db = Path(__file__).parent / "data" / "report" / "every_kind.db"
    events = _trace(db, tmp_path)["traceEvents"]
    _well_formed(events)
    findings, _ = load(Store.open(db))
    instants = _by(events, "i")
    assert Counter(e["name"].split(":")[0] for e in instants) == \
        Counter(str(f.kind) for f in findings for _ in (f.culprits or [None]))
    (nobody,) = [e for e in instants if e["s"] == "g"]
    assert nobody["name"].startswith("reduction_error") and nobody["args"]["culprits"] == []
    assert nobody["tid"] not in {e["tid"] for e in _by(events, "X")}


def test_records_modes_read_alike(dbs, tmp_path):
    """SQL rows keep no phase: the calls are paired by key, and the trace is the same as
    from the records file or batches kept in the database."""
    for a, b in (("demo", "demo_rows"), ("demo", "demo_batches"), ("died", "died_rows")):
        ea, eb = (sorted(json.dumps(e, sort_keys=True) for e in _trace(dbs[x], tmp_path)
                         ["traceEvents"]) for x in (a, b))
        assert ea == eb, a


def test_step_window(dbs, tmp_path, capsys):
    events = _trace(dbs["demo"], tmp_path, "--from", "15", "--to", "25")["traceEvents"]
    assert capsys.readouterr().err.strip().endswith("steps 15–25")
    steps = {e["args"]["step"] for e in _by(events, "X")}
    assert steps == set(range(15, 26))
    # an all_reduce each step, broadcasts at 15, 20, 25, an all_gather at 20; 4 ranks
    assert len(_by(events, "X")) == (11 + 3 + 1) * 4
    assert [e["name"].split(":")[0] for e in _by(events, "i")] == ["value_mismatch"]


def test_death_leaves_open_slices(dbs, tmp_path, capsys):
    doc = _trace(dbs["died"], tmp_path)
    assert "20 calls (3 never completed), 1 finding," in capsys.readouterr().err
    events = doc["traceEvents"]
    _well_formed(events)
    open_ = _by(events, "B")
    assert sorted(_rank(e) for e in open_) == [0, 1, 3]  # waiting for the dead rank
    assert all(e["args"]["seq"] == 5 and "never completed" in e["args"]["open"]
               and e["name"] == "all_reduce (never completed)" for e in open_)
    assert not _by(events, "E")
    (died_at,) = _by(events, "i")
    assert _rank(died_at) == CULPRIT and died_at["name"].startswith("rank_died")
    assert "killed by signal 9" in died_at["args"]["text"]


def test_analyze_writes_the_trace(dbs, tmp_path, capsys):
    out = tmp_path / "analyzed.json"
    dump = demo_dump(tmp_path / "demo.ccw")
    assert main(["analyze", str(dump), "--json", "--trace", str(out)]) == 1
    assert "156 calls" in capsys.readouterr().err
    events = json.loads(out.read_text())["traceEvents"]
    assert len(_by(events, "X")) == 156 and len(_by(events, "i")) == 2


def test_streams_in_bounded_memory(tmp_path):
    """A 10k-call database: the trace is written while it is read, never held whole."""
    db = tmp_path / "big.db"
    store = Store.create(db)
    b = BatchBuilder("big", 0, "node0", 1)
    for part in range(40):  # batches of 500 records, as relays send them
        recs = []
        for i in range(part * 250, (part + 1) * 250):
            base = dict(group_name="0", group_ranks=(0,), seq=i, op="all_reduce",
                        dtype="bfloat16", callsite="train.py:1 step", numel_in=8,
                        numel_out=8, step=i // 10, t_enter=T0 + i * 1e-3)
            recs += [Record(**base, phase=PHASE_ENTRY), Record(**base, t_exit=T0 + i * 1e-3)]
        store.add_batch(_decoded(b, recs, part))
    store.close()
    tracemalloc.start()
    try:
        stats = write_trace(Store.open(db), _Sink(), Steps())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stats.slices == 10_000 and stats.open == 0
    assert stats.bytes > 2_000_000
    assert peak < stats.bytes / 4, (peak, stats.bytes)  # ~0.4 MB: one batch, its events


class _Sink(io.RawIOBase):
    """An output that keeps nothing but the count of bytes written to it."""

    def __init__(self):
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.n += len(b)
        return len(b)

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.n


def _decoded(b: BatchBuilder, recs: list[Record], seq: int):
    from commcheck.wire import decode

    return decode(encode(b.build(recs, seq=seq)))


def test_bad_input_is_one_line(dbs, tmp_path, capsys):
    cases = [
        (["trace", str(tmp_path / "none.db"), "-o", str(tmp_path / "x.json")], "no such file"),
        (["trace", str(dbs["demo"]), "-o", str(tmp_path / "no" / "x.json")], "cannot write"),
        (["trace", str(dbs["demo"]), "-o", str(tmp_path / "x.json"), "--from", "9", "--to",
          "3"], "--from 9 is after --to 3"),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not list(tmp_path.glob("*.json*"))
