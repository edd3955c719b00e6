"""A run that did not finish never reads clean: `report`, `analyze` and `collect` name the
ranks that never said goodbye (and what each last entered), an empty database names its
likely cause, and all three exit 3 (DESIGN.md rule 7)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from commcheck.cli import main
from commcheck.collector.pipeline import Pipeline
from commcheck.collector.report import (
    CLEAN,
    FINDINGS,
    UNFINISHED,
    exit_status,
    load,
    render,
    unfinished,
)
from commcheck.collector.store import Store
from commcheck.engine import Engine
from commcheck.wire import (
    DUMP_MAGIC,
    GOODBYE,
    HELLO,
    PHASE_ENTRY,
    BatchBuilder,
    encode,
    write_frame,
)

from ..records import rec

pytestmark = pytest.mark.timeout(30)


def _db(tmp_path, world: int, script: dict[int, list], goodbye: set[int], name="run.db"):
    """A database as a collector leaves it: hello, ``script[rank]`` records, goodbye for the
    ranks in ``goodbye``."""
    path = tmp_path / name
    pipe = Pipeline(Engine(world, hang_timeout=5.0), Store.create(path))
    for rank, records in script.items():
        b = BatchBuilder("r", rank, f"node{rank // 2}", world)
        pipe.feed(encode(b.control(HELLO, 0)))
        if records:
            pipe.feed(encode(b.build(records, seq=1)))
        if rank in goodbye:
            pipe.feed(encode(b.control(GOODBYE, 2)))
    pipe.close_run(1e12)
    pipe.persist()
    pipe.store.close()
    return path


def _text(path) -> str:
    findings, summary = load(Store.open(path))
    out = io.StringIO()
    render(findings, summary, Console(file=out, width=200, color_system=None))
    return out.getvalue()


def _calls(seqs, ranks=(0, 1, 2, 3)):
    return [rec(seq=s, ranks=ranks, callsite=f"train.py:{40 + s} step") for s in seqs]


def test_a_finished_clean_run_exits_0(tmp_path):
    path = _db(tmp_path, 4, {r: _calls(range(3)) for r in range(4)}, goodbye={0, 1, 2, 3})
    findings, summary = load(Store.open(path))
    assert (summary.unfinished, summary.world, exit_status(findings, summary)) == ([], 4, CLEAN)
    assert main(["report", str(path)]) == CLEAN


def test_a_rank_without_goodbye_names_its_last_entry_and_exits_3(tmp_path, capsys):
    script = {r: _calls(range(3)) for r in range(4)}
    script[2] = _calls(range(2)) + [rec(seq=2, phase=PHASE_ENTRY, callsite="train.py:42 step")]
    path = _db(tmp_path, 4, script, goodbye={0, 1, 3})
    findings, summary = load(Store.open(path))
    [u] = summary.unfinished
    assert (u.rank, u.host, u.never_reported) == (2, "node1", False)
    assert (u.last.op, u.last.at, u.last.callsite) == ("all_reduce", "0[0-3] seq 2",
                                                        "train.py:42 step")
    assert exit_status(findings, summary) == UNFINISHED
    text = _text(path)
    assert "the run did not finish: 1 of 4 ranks never said goodbye" in text
    assert "rank 2 (node1): last entered all_reduce 0[0-3] seq 2 at train.py:42 step" in text
    assert main(["report", str(path)]) == UNFINISHED
    assert main(["report", str(path), "--json"]) == UNFINISHED
    assert '"unfinished"' in capsys.readouterr().out


def test_unfinished_wins_over_findings(tmp_path):
    script = {r: [rec(seq=0, out=(9, 9) if r == 1 else (1, 1))] for r in range(4)}
    finished = _db(tmp_path, 4, script, goodbye={0, 1, 2, 3}, name="a.db")
    unfinished = _db(tmp_path, 4, script, goodbye={0, 1, 2}, name="b.db")
    assert main(["report", str(finished)]) == FINDINGS
    assert main(["report", str(unfinished)]) == UNFINISHED


def test_a_rank_that_never_reported_is_named(tmp_path):
    path = _db(tmp_path, 4, {r: _calls(range(2), ranks=(0, 1, 2)) for r in range(3)},
               goodbye={0, 1, 2})
    findings, summary = load(Store.open(path))
    assert [(u.rank, u.never_reported, u.last) for u in summary.unfinished] == [(3, True, None)]
    assert exit_status(findings, summary) == UNFINISHED
    assert "rank 3: never reported" in _text(path)


def test_an_empty_database_names_the_likely_cause(tmp_path):
    nobody = _db(tmp_path, 4, {}, goodbye=set(), name="nobody.db")
    text = _text(nobody)
    assert "no rank ever connected" in text and "commcheck.patch()" in text
    assert "COMMCHECK_COLLECTOR" in text
    assert main(["report", str(nobody)]) == UNFINISHED
    crashed = _db(tmp_path, 4, {r: [] for r in range(4)}, goodbye={0, 1, 2, 3}, name="c.db")
    assert "4 ranks connected but recorded no collective" in _text(crashed)
    assert main(["report", str(crashed)]) == UNFINISHED


def test_analyze_exits_like_report(tmp_path):
    """Dump files of a run whose rank 2 ended without a goodbye."""
    for rank in range(4):
        b = BatchBuilder("r", rank, "h", 4)
        msgs = [b.control(HELLO, 0), b.build(_calls(range(3)), seq=1)]
        if rank != 2:
            msgs.append(b.control(GOODBYE, 2))
        with open(tmp_path / f"rank{rank:05d}.ccw", "wb") as f:
            f.write(DUMP_MAGIC)
            for m in msgs:
                write_frame(f, encode(m))
    assert main(["analyze", str(tmp_path), "--db", str(tmp_path / "out.db")]) == UNFINISHED


def test_ranks_that_never_reported_are_one_span_each_and_counted(tmp_path):
    """A node that never started (ranks 4-7 of 10) is one line, not one per rank; a lone
    gap (rank 9) stays a rank; the headline counts ranks. A world claimed by millions costs
    the report nothing more than a world of ten."""
    script = {r: _calls(range(2), ranks=(0, 1, 2, 3, 8)) for r in (0, 1, 2, 3, 8)}
    path = _db(tmp_path, 10, script, goodbye={0, 1, 2, 3, 8})
    findings, summary = load(Store.open(path))
    assert [(u.rank, u.through, u.count) for u in summary.unfinished] == \
        [(4, 7, 4), (9, None, 1)]
    text = _text(path)
    assert "5 of 10 ranks never said goodbye" in text
    assert "ranks 4-7: never reported" in text and "rank 9: never reported" in text
    assert exit_status(findings, summary) == UNFINISHED
    [huge] = unfinished([], 1 << 22)
    assert (huge.rank, huge.through, huge.count) == (0, (1 << 22) - 1, 1 << 22)
