"""Aggregation: the host, rank or link the findings point at, and the report that says so."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from commcheck.collector.report import build_summary, render
from commcheck.collector.store import RankRow, StoreSummary
from commcheck.engine import Finding, Kind
from commcheck.engine.findings import (
    Desync,
    HostSuspect,
    LastCall,
    LinkCorruption,
    MissingRank,
    NanInf,
    NanInfCount,
    RankSum,
    ReductionError,
    Side,
    ValueMismatch,
    Variant,
)
from commcheck.engine.suspects import describe, link_matrix, suspects

pytestmark = pytest.mark.timeout(30)
HOSTS = {r: f"node-{r // 4}" for r in range(16)}


def f(culprits=(13,), detail=None, ambiguous=False) -> Finding:
    detail = detail or ValueMismatch(sides=[Side(ranks=list(culprits), hash="0" * 32)])
    kind = {LinkCorruption: Kind.LINK_CORRUPTION, Desync: Kind.DESYNC,
            MissingRank: Kind.MISSING_RANK, NanInf: Kind.NAN_INF,
            ReductionError: Kind.REDUCTION_ERROR}.get(type(detail), Kind.VALUE_MISMATCH)
    return Finding(kind=kind, run="r", op="all_reduce", group="0[0-15]", seq=1, step=0,
                   culprits=list(culprits), hosts=sorted({HOSTS[c] for c in culprits}),
                   callsite="x.py:1 f", detail=detail, ambiguous=ambiguous)


def links(*pairs: tuple[int, int]) -> LinkCorruption:
    return LinkCorruption(links=list(pairs))


def variant(ranks: list[int], numel_in: int) -> Variant:
    return Variant(ranks=ranks, op="all_reduce", dtype="float32", numel_in=numel_in,
                   numel_out=100, shape_in=[numel_in], redop="SUM", root=-1, splits=([], []),
                   callsites=["x.py:1 f"])


def test_all_culprits_on_one_host_make_it_the_suspect():
    findings = [f(culprits=[12]), f(culprits=[13]), f(culprits=[15]), f(culprits=[14, 15])]
    [s] = [s for s in suspects(findings, HOSTS) if isinstance(s, HostSuspect)]
    # findings, not culprits: [14, 15] is one finding against node-3 (issue 18)
    assert (s.host, s.ranks, s.findings, s.of) == ("node-3", [12, 13, 14, 15], 4, 4)
    assert describe(s) == "suspect host node-3: 4 of 4 findings on ranks 12–15"


def test_spread_culprits_accuse_no_host():
    findings = [f(culprits=[1]), f(culprits=[6]), f(culprits=[11])]
    assert not [s for s in suspects(findings, HOSTS) if s.kind == "host"]


def test_single_host_jobs_have_no_host_suspect():
    assert suspects([f(culprits=[1])], {0: "a", 1: "a"}) == []


def test_one_link_carrying_most_corruption_is_named():
    findings = [f([3], links((1, 3))), f([3], links((1, 3), (2, 3))), f([3], links((1, 3)))]
    assert link_matrix(findings) == {(1, 3): 3, (2, 3): 1}
    kinds = {s.kind: s for s in suspects(findings, HOSTS)}
    assert (kinds["link"].src, kinds["link"].dst, kinds["link"].chunks) == (1, 3, 3)
    assert kinds["receiver"].rank == 3  # every corrupted chunk landed on rank 3
    assert "sender" not in kinds  # rank 1 sent to one peer only: the link says it all


def test_ambiguous_findings_accuse_nobody():
    assert suspects([f(culprits=[0, 5], ambiguous=True), f(culprits=[0, 5], ambiguous=True)],
                    HOSTS) == []


def test_report_renders_every_kind_with_suspects_first():
    findings = [
        f([3], links((1, 3))),
        f([3], links((1, 3))),
        f([2], Desync(fields=["numel_in"], variants=[variant([0, 1, 3], 100),
                                                     variant([2], 99)])),
        f([2], MissingRank(waiting=[0, 1, 3], waited_s=31.5, last={"2": LastCall(
            op="all_reduce", at="0[0-3] seq 4", ago_s=40.0, callsite="x",
            said_goodbye=False)})),
        f([1], NanInf(inputs={"1": NanInfCount(nan=3, inf=0)},
                      later_collectives_with_nan_inf=7)),
        f([], ReductionError(ranks={"0": RankSum(abs_err=5.0, expected_sum=1.0,
                                                 output_sum=6.0, tolerance=0.1)}),
          ambiguous=True),
    ]
    summary = build_summary(findings, StoreSummary(records=10, findings=6, runs=["r"], ranks=[
        RankRow(run="r", rank=r, host=HOSTS[r], node=0, hello=True, goodbye=True, records=1,
                counters={}) for r in range(4)], counters={}))
    out = io.StringIO()
    render(findings, summary, Console(file=out, width=250))
    text = out.getvalue()
    assert text.index("suspect link 1→3") < text.index("6 findings")
    assert "differ in numel_in: [0,1,3] numel_in=100 | [2] numel_in=99" in text
    assert "ranks 0,1,3 waiting for 31.5 s; rank 2 last in all_reduce 0[0-3] seq 4" in text
    assert "inputs rank 1: 3 NaN 0 Inf; 7 later collectives carried it" in text
    assert "src \\ dst" in text and "│ 1         │ 2 │" in text
    assert summary.link_matrix == [(1, 3, 2)]


def test_a_send_recv_desync_shows_what_each_side_moved():
    """A p2p desync differs in "numel", which no variant field is called: the sender's
    numel_in against the receiver's numel_out (this used to raise KeyError)."""
    send = Variant(ranks=[1], op="send", dtype="float32", numel_in=40, numel_out=0,
                   shape_in=[40], redop="", root=3, splits=([], []), callsites=["x.py:1 f"])
    recv = Variant(ranks=[3], op="recv", dtype="float32", numel_in=0, numel_out=39,
                   shape_in=[], redop="", root=1, splits=([], []), callsites=["x.py:2 g"])
    findings = [f([1, 3], Desync(fields=["numel"], variants=[send, recv]), ambiguous=True)]
    out = io.StringIO()
    render(findings, build_summary(findings, StoreSummary(records=2, findings=1, runs=["r"],
                                                          ranks=[], counters={})),
           Console(file=out, width=250))
    assert "differ in numel: [1] numel=40 | [3] numel=39" in out.getvalue()
