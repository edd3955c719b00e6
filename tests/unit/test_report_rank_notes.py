"""What the report says from the ranks' own words: call sites as the ranks wrote them (a
framework's frame and the user's, each on one line), faults that never fired."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from commcheck.collector.report import _short, build_summary, render
from commcheck.collector.store import RankRow, StoreSummary
from commcheck.engine import Finding, Kind
from commcheck.engine.findings import Side, ValueMismatch

pytestmark = pytest.mark.timeout(30)
FRAMEWORK = "lightning/fabric/utilities/distributed.py:214 _sync_ddp"
USER = "train.py:57 training_step"


def finding(site: str) -> Finding:
    return Finding(kind=Kind.VALUE_MISMATCH, run="r", op="ddp_allreduce", group="0[0-1]",
                   seq=1, step=3, culprits=[0, 1], hosts=["node-0"], callsite=site,
                   detail=ValueMismatch(sides=[Side(ranks=[0], hash="0" * 32),
                                               Side(ranks=[1], hash="1" * 32)]),
                   ambiguous=True)


def stored(counters: dict[int, dict[str, int]] | None = None) -> StoreSummary:
    counters = counters or {}
    return StoreSummary(records=4, findings=0, runs=["r"], counters={"verified": 2},
                        ranks=[RankRow(run="r", rank=r, host="node-0", node=0, hello=True,
                                       goodbye=True, records=2, counters=counters.get(r, {}))
                               for r in (0, 1)])


def text(findings: list[Finding], summary, width: int = 160) -> str:
    buf = io.StringIO()
    render(findings, summary, Console(file=buf, width=width, color_system=None,
                                      force_terminal=False, no_color=True))
    return buf.getvalue()


def test_framework_and_user_frames_each_stay_on_one_line():
    fs = [finding(f"{FRAMEWORK} ← {USER}")]
    lines = text(fs, build_summary(fs, stored()), width=200).splitlines()
    assert any(FRAMEWORK in line for line in lines)
    assert any(f"← {USER}" in line for line in lines)
    assert not any("../" in line for line in lines)


def test_a_framework_site_takes_at_most_three_lines_at_160_columns():
    fs = [finding(f"{FRAMEWORK} ← {USER}")]
    lines = text(fs, build_summary(fs, stored())).splitlines()
    rows = [line for line in lines if line.startswith("│") and "ddp_allreduce" in line
            or line.startswith("│         │")]
    assert len(rows) <= 3
    assert any(f"← {USER}" in line for line in rows)
    assert any("how far apart" in line for line in lines)  # the table is not cropped


def test_sites_are_never_climbed_out_of():
    here = os.getcwd()
    assert _short(os.path.join(here, "job", "train.py") + ":5 main") == "job/train.py:5 main"
    far = "/elsewhere/proj/train.py:5 main"
    assert _short(far) == far
    assert _short(f"{FRAMEWORK} ← {USER}") == f"{FRAMEWORK}\n← {USER}"


def test_unfired_faults_are_listed_with_what_the_rank_recorded():
    from commcheck.collector.report import to_json
    from commcheck.wire.faults import to_counters

    counters = {1: to_counters(["bitflip:rank=1,op=all_reduce,call=21"],
                               {"ddp_allreduce": 30, "barrier": 2}),
                0: to_counters(["nan:rank=7,op=broadcast,call=1"], {})}
    summary = build_summary([], stored(counters))
    out = text([], summary)
    assert "2 injected faults never fired" in out
    assert ("rank 1: bitflip:rank=1,op=all_reduce,call=21: it recorded ddp_allreduce ×30, "
            "barrier ×2") in out
    assert "nan:rank=7,op=broadcast,call=1: no such rank in the world" in out
    doc = to_json([], summary)["summary"]["unfired_faults"]
    assert doc == [{"rank": 0, "unfired": ["nan:rank=7,op=broadcast,call=1"], "recorded": {}},
                   {"rank": 1, "unfired": ["bitflip:rank=1,op=all_reduce,call=21"],
                    "recorded": {"barrier": 2, "ddp_allreduce": 30}}]


def test_a_run_whose_faults_all_fired_says_nothing_of_them():
    from commcheck.collector.report import to_json

    summary = build_summary([], stored({1: {"inject.recorded:all_reduce": 40}}))
    assert "never fired" not in text([], summary)
    assert "unfired_faults" not in to_json([], summary)["summary"]
