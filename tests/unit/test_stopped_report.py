"""A run stopped together (a cancelled job): the engine's ``stopped.<rank>`` counters become
one report line per signal, in the terminal, the JSON and the web page."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from commcheck.collector.html import page
from commcheck.collector.report import build_summary, exit_status, render, to_json
from commcheck.collector.store import RankRow, StoreSummary

LINE = ("stopped together by SIGTERM: ranks 0-3 (a cancel or a time limit: every rank "
        "signalled at once, none failed first, so no rank is blamed)")


def test_ranks_stopped_together_are_one_line_and_the_run_did_not_finish():
    ranks = [RankRow(run="r", rank=r, host="n", node=0, hello=True, goodbye=False,
                     records=10, counters={}) for r in range(4)]
    stored = StoreSummary(records=40, findings=0, runs=["r"], ranks=ranks,
                          counters={"world": 4, "verified": 9,
                                    **{f"stopped.{r}": 15 for r in range(4)}})
    summary = build_summary([], stored)
    assert to_json([], summary)["summary"]["stopped"] == [{"ranks": [0, 1, 2, 3],
                                                           "signal": 15}]
    assert exit_status([], summary) == 3
    out = StringIO()
    render([], summary, Console(file=out, width=200))
    assert f"  {LINE}\n" in out.getvalue()
    assert f"<p>{LINE}</p>" in page("run.db", [], summary, [])
    stored.counters = {"world": 4, "verified": 9}
    assert "stopped together" not in page("run.db", [], build_summary([], stored), [])
