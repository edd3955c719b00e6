"""Aggregation: the host, rank or link the findings point at, and the report that says so."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from commcheck.collector.report import build_summary, render
from commcheck.engine import Finding
from commcheck.engine.suspects import describe, link_matrix, suspects

pytestmark = pytest.mark.timeout(30)
HOSTS = {r: f"node-{r // 4}" for r in range(16)}


def f(kind="value_mismatch", culprits=(13,), ambiguous=False, **detail) -> Finding:
    return Finding(kind=kind, run="r", op="all_reduce", group="0[0-15]", seq=1, step=0,
                   culprits=list(culprits), hosts=sorted({HOSTS[c] for c in culprits}),
                   callsite="x.py:1 f", detail=detail, ambiguous=ambiguous)


def test_all_culprits_on_one_host_make_it_the_suspect():
    findings = [f(culprits=[12]), f(culprits=[13]), f(culprits=[15]), f(culprits=[14, 15])]
    [s] = [s for s in suspects(findings, HOSTS) if s["kind"] == "host"]
    assert (s["host"], s["ranks"], s["findings"], s["of"]) == ("node-3", [12, 13, 14, 15], 5, 5)
    assert describe(s) == "suspect host node-3: 5 of 5 findings on ranks 12–15"


def test_spread_culprits_accuse_no_host():
    findings = [f(culprits=[1]), f(culprits=[6]), f(culprits=[11])]
    assert not [s for s in suspects(findings, HOSTS) if s["kind"] == "host"]


def test_single_host_jobs_have_no_host_suspect():
    assert suspects([f(culprits=[1])], {0: "a", 1: "a"}) == []


def test_one_link_carrying_most_corruption_is_named():
    findings = [f("link_corruption", [3], links=[[1, 3]]),
                f("link_corruption", [3], links=[[1, 3], [2, 3]]),
                f("link_corruption", [3], links=[[1, 3]])]
    assert link_matrix(findings) == {(1, 3): 3, (2, 3): 1}
    kinds = {s["kind"]: s for s in suspects(findings, HOSTS)}
    assert (kinds["link"]["src"], kinds["link"]["dst"], kinds["link"]["chunks"]) == (1, 3, 3)
    assert kinds["receiver"]["rank"] == 3  # every corrupted chunk landed on rank 3
    assert "sender" not in kinds  # rank 1 sent to one peer only: the link says it all


def test_ambiguous_findings_accuse_nobody():
    assert suspects([f(culprits=[0, 5], ambiguous=True), f(culprits=[0, 5], ambiguous=True)],
                    HOSTS) == []


def test_report_renders_every_kind_with_suspects_first():
    findings = [
        f("link_corruption", [3], links=[[1, 3]]),
        f("link_corruption", [3], links=[[1, 3]]),
        f("desync", [2], fields=["numel_in"], variants=[
            {"ranks": [0, 1, 3], "numel_in": 100}, {"ranks": [2], "numel_in": 99}]),
        f("missing_rank", [2], waiting=[0, 1, 3], waited_s=31.5,
          last={"2": {"op": "all_reduce", "at": "0[0-3] seq 4", "ago_s": 40.0,
                      "callsite": "x", "said_goodbye": False}}),
        f("nan_inf", [1], inputs={"1": {"nan": 3, "inf": 0}},
          later_collectives_with_nan_inf=7),
        f("reduction_error", [], ambiguous=True, ranks={"0": {
            "abs_err": 5.0, "expected_sum": 1.0, "output_sum": 6.0, "tolerance": 0.1}}),
    ]
    summary = build_summary(findings, {"records": 10, "ranks": [
        {"rank": r, "host": HOSTS[r], "goodbye": True, "counters": {}} for r in range(4)]})
    out = io.StringIO()
    render(findings, summary, Console(file=out, width=250))
    text = out.getvalue()
    assert text.index("suspect link 1→3") < text.index("6 findings")
    assert "differ in numel_in: [0,1,3] numel_in=100 | [2] numel_in=99" in text
    assert "ranks 0,1,3 waiting for 31.5 s; rank 2 last in all_reduce 0[0-3] seq 4" in text
    assert "inputs rank 1: 3 NaN 0 Inf; 7 later collectives carried it" in text
    assert "src \\ dst" in text and "│ 1         │ 2 │" in text
    assert summary["link_matrix"] == [[1, 3, 2]]
