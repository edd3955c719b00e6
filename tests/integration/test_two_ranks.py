"""Two ranks that disagree (issue 18): torchrun, gloo, 2 ranks on one node, real collector.
With two ranks no majority can name the culprit; the records must."""

from __future__ import annotations

import pytest

from ..harness import WORKERS, call_lines, report_json, run_job, start_collector

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
COVERAGE = WORKERS / "coverage.py"
LINES = call_lines(COVERAGE)


@pytest.fixture(scope="module")
def two_faults(tmp_path_factory) -> tuple[int, list[dict]]:
    """One job of two ranks (tests/workers/coverage.py, its plain all_reduces and its DDP
    part under commcheck.watch), bit 30 flipped on rank 1 in each: in its 3rd all_reduce
    and in its 4th DDP bucket. (collector status, findings)."""
    tmp = tmp_path_factory.mktemp("two")
    col = start_collector(tmp, 2, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COVER_PARTS": "plain,ddp",
           "COMMCHECK_INJECT": "bitflip:rank=1,op=all_reduce,call=3,bit=30;"
                               "bitflip:rank=1,op=ddp_allreduce,call=4,bit=30"}
    for r in run_job(COVERAGE, env, nnodes=1, nproc=2):
        assert r.returncode == 0, r.stdout[-2000:]
    rc, out, err = col.wait()
    findings = report_json(col.db)[1]["findings"]
    assert sorted(f["op"] for f in findings) == ["all_reduce", "ddp_allreduce"], findings
    return rc, findings


def test_a_high_bit_flip_on_one_of_two_ranks_names_that_rank(two_faults):
    rc, findings = two_faults
    assert rc == 1
    [f] = [f for f in findings if f["op"] == "all_reduce"]
    assert (f["kind"], f["op"], f["culprits"], f["ambiguous"]) == ("value_mismatch",
                                                                   "all_reduce", [1], False)
    assert int(f["callsite"].split(" ")[0].rsplit(":", 1)[1]) == LINES["plain_ar"]
    tie = f["detail"]["tie"]
    assert tie["by"] == "reduction" and tie["decided"]
    assert tie["evidence"].startswith("rank 1 output sum ")
    assert [s["ranks"] for s in f["detail"]["sides"]] == [[0], [1]]


def test_a_high_bit_flip_in_a_ddp_bucket_of_two_replicas_names_that_rank(two_faults):
    """DDP under commcheck.watch (the coverage worker's DDP part), two ranks."""
    [f] = [f for f in two_faults[1] if f["op"] == "ddp_allreduce"]
    assert (f["kind"], f["culprits"], f["ambiguous"]) == ("value_mismatch", [1], False), f
    assert f["detail"]["tie"]["decided"] and f["detail"]["injected"]
