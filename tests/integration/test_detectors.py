"""Detectors on real failures: a desync, a hang, a NaN onset (torchrun, gloo, 4 ranks on 2
simulated nodes, real collector). Each has a clean counterpart in the clean part of the
NaN job here and of the fault jobs of test_spine.py and test_coverage.py (no finding but
the injected faults' there)."""

from __future__ import annotations

import signal
import sqlite3
import time

import pytest

from ..harness import WORKERS, call_lines, report_json, run_job, start_collector, start_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
FAULTS = WORKERS / "faults.py"
LINES = call_lines(FAULTS)


def _site(f: dict) -> int:
    return int(f["callsite"].split(" ")[0].rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def nan_onset(tmp_path_factory) -> tuple[int, list[dict]]:
    """Rank 1 sends a NaN into its 3rd all_reduce: (collector status, findings). One job for
    the NaN onset and the clean case around it (the calls before the onset, every
    all_gather), under the clean run's hang timeout of 3 s."""
    tmp = tmp_path_factory.mktemp("nan")
    col = start_collector(tmp, 4, "--exit-when-done", "--hang-timeout", "3")
    env = {"COMMCHECK_COLLECTOR": col.endpoint,
           "COMMCHECK_INJECT": "nan:rank=1,op=all_reduce,call=3"}
    for r in run_job(FAULTS, env):
        assert r.returncode == 0, r.stdout[-2000:]
    return col.wait()[0], report_json(col.db)[1]["findings"]


def test_clean_part_of_the_fault_worker_has_no_findings(nan_onset):
    """Nothing but the NaN onset: no value or link finding before it or on the all_gathers,
    no desync, no hang or straggler, and the run ended (status 1: findings, not 3)."""
    rc, findings = nan_onset
    assert [(f["kind"], f["seq"]) for f in findings] == [("nan_inf", 4)], findings
    assert rc == 1


def test_a_rank_calling_with_another_shape_is_a_desync(tmp_path):
    col = start_collector(tmp_path, 4, "--hang-timeout", "3")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "FAULT_TIMEOUT": "8",
           "COMMCHECK_INJECT": "shape:rank=2,op=all_reduce,call=5"}
    run_job(FAULTS, env)  # gloo aborts the mismatched call: exit codes are not ours
    col.terminate()
    findings = report_json(col.db)[1]["findings"]
    [d] = [f for f in findings if f["kind"] == "desync"]
    assert (d["op"], d["seq"], d["culprits"], d["hosts"]) == ("all_reduce", 8, [2], ["node1"])
    assert set(d["detail"]["fields"]) >= {"numel_in"}
    assert _site(d) == LINES["ar"]
    majority, odd = d["detail"]["variants"]
    assert majority["ranks"] == [0, 1, 3] and odd["ranks"] == [2]
    assert odd["numel_in"] < majority["numel_in"]
    assert not [f for f in findings if f["kind"] in ("value_mismatch", "link_corruption")]


def test_a_skipped_collective_is_a_missing_rank_while_the_others_wait(tmp_path):
    """Rank 3 skips its 8th all_gather and holds; the others block in it (gloo timeout
    13 s). The finding must come while they wait; then the job is stopped as a launcher
    stops it (SIGTERM to torchrun), not left to wait out the timeout."""
    col = start_collector(tmp_path, 4, "--hang-timeout", "3")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "FAULT_TIMEOUT": "13",
           "COMMCHECK_INJECT": "skip:rank=3,op=all_gather,call=8",
           "FAULT_HOLD_RANK": "3", "FAULT_HOLD": "10"}
    procs = start_job(FAULTS, env)
    seen, deadline = None, time.monotonic() + 120
    while seen is None and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            with sqlite3.connect(f"file:{col.db}?mode=ro", uri=True) as conn:
                seen = conn.execute("SELECT culprits, seq, op FROM findings "
                                    "WHERE kind='missing_rank'").fetchone()
        except sqlite3.OperationalError:
            pass
    alive = [p.poll() is None for p in procs]  # the others still block: gloo waits 13 s
    for p in procs:
        p.send_signal(signal.SIGTERM)  # torchrun stops its workers
    for p in procs:
        p.communicate(timeout=60)
    col.terminate()
    assert seen is not None and all(alive), "missing_rank must be raised while the job hangs"
    assert seen == ("[3]", 15, "all_gather")
    [m] = [f for f in report_json(col.db)[1]["findings"] if f["kind"] == "missing_rank"]
    assert m["detail"]["waiting"] == [0, 1, 2]
    last = m["detail"]["last"]["3"]
    assert last["op"] == "all_reduce" and last["at"] == "0[0-3] seq 14"  # its last call
    assert _site(m) == LINES["ag"]


def test_the_first_rank_to_send_nan_is_named_and_the_rest_fold_in(nan_onset):
    [f] = nan_onset[1]
    assert (f["kind"], f["op"], f["seq"], f["culprits"]) == ("nan_inf", "all_reduce", 4, [1])
    assert f["detail"]["inputs"]["1"]["nan"] >= 1
    assert f["detail"]["later_collectives_with_nan_inf"] > 0
    assert f["step"] == 2
