"""The HTML report in a real browser: headless Chromium from the distribution's packages
(.ci/run installs it; skipped, saying so, where there is none) opens the page of a demo-like
run with no console error or failed load, draws every figure, shows the findings
``report --json`` prints, and a screenshot of it is not blank."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from commcheck.cli import main

from .. import browser
from ..demo_runs import demo

pytestmark = pytest.mark.timeout(120)

ROWS = """JSON.stringify([...document.querySelectorAll('tr.finding')].map(tr => {
  const t = c => tr.querySelector(c).innerText;
  return {kind: t('.kind'), op: t('.op'), group: t('.group'), seq: +t('.seq'),
          step: +t('.step'), culprits: t('.culprits'), hosts: t('.hosts'),
          callsite: t('.site')};
}))"""
IMAGES = """JSON.stringify([...document.images].map(i => [i.complete, i.naturalWidth,
  i.getBoundingClientRect().width]))"""


@pytest.fixture(scope="module")
def page():
    exe = browser.find()
    if exe is None:
        pytest.skip(browser.WHY_NOT)
    p = browser.Page(exe, width=1280, height=900)
    yield p
    p.close()


def _shown(f: dict) -> dict:
    """A finding of ``report --json`` as the page's table shows it."""
    return {"kind": f["kind"], "op": f["op"], "group": f["group"], "seq": f["seq"],
            "step": f["step"], "culprits": ",".join(map(str, f["culprits"])) or "—",
            "hosts": ",".join(f["hosts"]), "callsite": f["callsite"].replace(" ← ", "\n← ")}


def test_report_page_in_chromium(page, tmp_path, capsys):
    db = demo(tmp_path / "demo.db")
    html = tmp_path / "report.html"
    assert main(["report", str(db), "--json", "--html", str(html)]) == 1
    doc = json.loads(capsys.readouterr().out)
    page.open(html.as_uri())
    assert page.errors() == []
    assert page.evaluate("document.title") == "commcheck report: demo.db"
    rows = json.loads(page.evaluate(ROWS))
    assert rows == [_shown(f) for f in doc["findings"]] and len(rows) == 2
    images = json.loads(page.evaluate(IMAGES))
    assert len(images) == 3 and all(done and w > 0 and shown > 200
                                    for done, w, shown in images), images
    shot = page.screenshot()
    from PIL import Image  # matplotlib's own dependency

    img = Image.open(io.BytesIO(shot)).convert("RGB")
    assert img.width == 1280 and img.height > 1500  # the whole page, figures included
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text, tables, figures: not blank
    white = max(colors)[0] / (img.width * img.height)
    assert white < 0.9, white
    Path(tmp_path / "report.png").write_bytes(shot)


def test_console_errors_are_heard(page):
    """The check above can fail: a page that logs an error and throws is caught."""
    page.events.clear()
    page.open("data:text/html,<p>x</p><script>console.error('boom');undefined_fn()</script>")
    errors = page.errors()
    assert any("boom" in e for e in errors) and any("exception" in e for e in errors), errors
