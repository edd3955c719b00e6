"""The report is the product's API: what ``commcheck report`` makes of a database an older
collector wrote stays byte for byte the same, as JSON and as text.

``data/report/`` holds the databases (every finding kind, every suspect, a clean run; see
``make.py`` there for what each one holds and how it was written) and, beside each, the
``--json`` output and the rich report at 160 columns without color that it must produce.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from commcheck.cli import main
from commcheck.collector.report import load, render
from commcheck.collector.store import Store

pytestmark = pytest.mark.timeout(60)
DATA = Path(__file__).parent / "data" / "report"
CASES = ("every_kind", "suspects", "clean", "liveness", "ties", "words")


def text_console(buf: io.StringIO) -> Console:
    """The console the expected ``*.txt`` files were rendered on."""
    return Console(file=buf, width=160, color_system=None, force_terminal=False,
                   force_jupyter=False, legacy_windows=False, no_color=True)


@pytest.fixture
def db(request, tmp_path) -> Path:
    """A copy of the case's database: opening it must not touch the committed file."""
    path = tmp_path / f"{request.param}.db"
    shutil.copyfile(DATA / f"{request.param}.db", path)
    return path


@pytest.mark.parametrize("db", CASES, indirect=True)
def test_json_report_is_byte_identical(db, capsys):
    rc = main(["report", str(db), "--json"])
    out, err = capsys.readouterr()
    assert out == (DATA / f"{db.stem}.json").read_text()
    status = {"clean": 0, "liveness": 3, "words": 3}.get(db.stem, 1)  # 3: nobody said goodbye
    assert (rc, err) == (status, "")


@pytest.mark.parametrize("db", CASES, indirect=True)
def test_text_report_is_byte_identical(db):
    findings, summary = load(Store.open(db))
    buf = io.StringIO()
    render(findings, summary, text_console(buf))
    assert buf.getvalue() == (DATA / f"{db.stem}.txt").read_text()


@pytest.mark.parametrize("db", ["ties"], indirect=True)
def test_two_ranks_read_right(db):
    """Issue 18's two-rank words: one culprit with its evidence, an ambiguous tie with its
    reason, one link_corruption alone, a corrupted receive named as the recv, and the
    per-op table with the DDP name."""
    findings, summary = load(Store.open(db))
    assert [(f.kind, f.op, f.culprits, f.ambiguous) for f in findings] == [
        ("value_mismatch", "all_reduce", [1], False),
        ("value_mismatch", "ddp_allreduce", [0, 1], True),
        ("link_corruption", "all_gather", [1], False),
        ("link_corruption", "recv", [1], False)]
    assert findings[0].detail.tie.evidence.startswith(
        "rank 1 output sum -1.43e+37, inputs reduce to -1.52")
    assert "cannot be told from rounding" in findings[1].detail.tie.evidence
    assert {(o.op, o.recorded, o.verified) for o in summary.ops} >= {
        ("ddp_allreduce", 2, 1), ("send", 1, 1), ("recv", 1, 1)}


@pytest.mark.parametrize("db", ["words"], indirect=True)
def test_the_reports_words_are_true(db):
    """Two culprits named alike on one host count one finding each for the host; the
    ranks that entered are waiting only when alive, else said dead."""
    findings, summary = load(Store.open(db))
    buf = io.StringIO()
    render(findings, summary, text_console(buf))
    text = buf.getvalue()
    assert "suspect host node1: 3 of 4 findings on ranks 2,3" in text
    [missing] = [f for f in findings if f.kind == "missing_rank"]
    assert missing.detail.not_waiting == {"1": "died"}
    assert "rank 0 waiting for 40.0 s; rank 1 entered it, then" in text
    assert "ranks 0,1 waiting" not in text
