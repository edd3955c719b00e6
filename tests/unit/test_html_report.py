"""``commcheck report DB --html FILE``: one private, self-contained page built from the same
model as ``report --json`` (a demo-like run written through the real collector path, and a
stored clean database). The page in a real browser: tests/integration/test_html_browser.py."""

from __future__ import annotations

import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from commcheck.cli import main

from ..demo_runs import demo

pytestmark = pytest.mark.timeout(60)

STORED = Path(__file__).parent / "data" / "report"


class _Page(HTMLParser):
    """What a page loads from elsewhere, its embedded report, its finding rows."""

    def __init__(self):
        super().__init__()
        self.refs: list[str] = []
        self.tags: list[str] = []
        self.json = ""
        self.rows = 0
        self._in_json = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href", "srcset", "action") and v]
        if tag == "tr" and "finding" in (a.get("class") or "").split():
            self.rows += 1
        self._in_json = tag == "script" and a.get("id") == "report-json"

    def handle_endtag(self, tag):
        self._in_json = False

    def handle_data(self, data):
        if self._in_json:
            self.json += data


def _report(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory) -> Path:
    return demo(tmp_path_factory.mktemp("html") / "demo.db")


def test_page_is_the_json_report_self_contained(demo_db, tmp_path, capsys):
    page = tmp_path / "report.html"
    rc, out, err = _report(["report", str(demo_db), "--json", "--html", str(page)], capsys)
    rc_json, out_json, _ = _report(["report", str(demo_db), "--json"], capsys)
    assert rc == rc_json == 1 and out == out_json  # --html adds a file, changes nothing else
    assert err.strip().startswith(f"{page}: ") and err.strip().endswith("self-contained")
    assert os.stat(page).st_mode & 0o777 == 0o600
    text = page.read_text()
    p = _Page()
    p.feed(text)
    assert json.loads(p.json) == json.loads(out_json)
    assert p.rows == len(json.loads(out_json)["findings"]) == 2
    assert "link" not in p.tags and "iframe" not in p.tags
    assert p.refs and all(r.startswith("data:image/svg+xml;base64,") for r in p.refs), p.refs
    assert not re.search(r"url\(|@import|https?://", text.split("<script")[0])
    assert p.tags.count("img") == 3  # findings by rank x step, the link matrix, calls per op
    for word in ("value_mismatch", "link_corruption", "train_demo.py:60 train_step",
                 "suspect host node1", "sum differs by 2.5"):
        assert word in text, word


def test_clean_run_page(tmp_path, capsys):
    page = tmp_path / "clean.html"
    rc, _, _ = _report(["report", str(STORED / "clean.db"), "--html", str(page)], capsys)
    assert rc == 0
    text = page.read_text()
    assert "verdict v-clean" in text and "No findings" in text
    assert "no finding names a culprit" in text and "no corrupted chunk" in text
    assert text.count("<img") == 1  # only the calls per op


def test_unwritable_html_is_one_line(demo_db, tmp_path, capsys):
    rc, _, err = _report(["report", str(demo_db), "--html",
                          str(tmp_path / "no" / "r.html")], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot write the report" in lines[0], lines
    assert not list(tmp_path.rglob("*.html*"))
