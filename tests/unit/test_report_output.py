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
CASES = ("every_kind", "suspects", "clean", "liveness")


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
    status = {"clean": 0, "liveness": 3}.get(db.stem, 1)  # liveness: nobody said goodbye
    assert (rc, err) == (status, "")


@pytest.mark.parametrize("db", CASES, indirect=True)
def test_text_report_is_byte_identical(db):
    findings, summary = load(Store.open(db))
    buf = io.StringIO()
    render(findings, summary, text_console(buf))
    assert buf.getvalue() == (DATA / f"{db.stem}.txt").read_text()
