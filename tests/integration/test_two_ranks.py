"""Two ranks that disagree (issue 18): torchrun, gloo, 2 ranks on one node, real collector.
With two ranks no majority can name the culprit; the records must."""

from __future__ import annotations

import pytest

from ..harness import WORKERS, call_lines, report_json, run_job, start_collector

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
FAULTS = WORKERS / "faults.py"
LINES = call_lines(FAULTS)


def test_a_high_bit_flip_on_one_of_two_ranks_names_that_rank(tmp_path):
    col = start_collector(tmp_path, 2, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "FAULT_ITERS": "4",
           "COMMCHECK_INJECT": "bitflip:rank=1,op=all_reduce,call=3,bit=30"}
    for r in run_job(FAULTS, env, nnodes=1, nproc=2):
        assert r.returncode == 0, r.stdout[-2000:]
    rc, out, err = col.wait()
    assert rc == 1, err
    findings = report_json(col.db)[1]["findings"]
    [f] = findings
    assert (f["kind"], f["op"], f["culprits"], f["ambiguous"]) == ("value_mismatch",
                                                                   "all_reduce", [1], False)
    assert int(f["callsite"].split(" ")[0].rsplit(":", 1)[1]) == LINES["ar"]
    tie = f["detail"]["tie"]
    assert tie["by"] == "reduction" and tie["decided"]
    assert tie["evidence"].startswith("rank 1 output sum ")
    assert [s["ranks"] for s in f["detail"]["sides"]] == [[0], [1]]


def test_a_high_bit_flip_in_a_ddp_bucket_of_two_replicas_names_that_rank(tmp_path):
    """DDP under commcheck.watch (the coverage worker's DDP part), two ranks."""
    col = start_collector(tmp_path, 2, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COVER_PARTS": "ddp",
           "COMMCHECK_INJECT": "bitflip:rank=1,op=ddp_allreduce,call=4,bit=30"}
    for r in run_job(WORKERS / "coverage.py", env, nnodes=1, nproc=2):
        assert r.returncode == 0, r.stdout[-2000:]
    col.wait()
    findings = report_json(col.db)[1]["findings"]
    [f] = [f for f in findings if f["op"] == "ddp_allreduce"]
    assert (f["kind"], f["culprits"], f["ambiguous"]) == ("value_mismatch", [1], False), f
    assert f["detail"]["tie"]["decided"] and f["detail"]["injected"]
