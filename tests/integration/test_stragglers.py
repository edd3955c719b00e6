"""Stragglers in real jobs (torchrun, gloo, real collector; docs/stragglers.md).

One 4-rank job on two simulated nodes serves several assertions: node1's clock is 3 s
ahead (the relay's test-only clock shift, as a node with a wrong clock would stamp its
records), and rank 3 on node1 spins an extra 100 ms per step from step 20 to step 50. The
collector must name rank 3 on node1 from step >= 20 within 30 s of the onset, end the
episode after step 50, and name nobody else (rank 2 shares the shifted clock). A 2-stage
pipeline (send/recv, stage 0 always last at the loss all_reduce by design) must read clean.
The job's fixture writes the onset-to-finding latency to its tmp dir (``latency``).
A clean job without the slowdown is the unit tests' (test_stragglers.py) and every clean
integration job's: those assert zero findings, stragglers included.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time

import pytest

from ..harness import BIN, WORKERS, _started, free_port, report_json, run_job, start_collector

pytestmark = [pytest.mark.integration, pytest.mark.serial]
SCRIPT = WORKERS / "straggling.py"
SLOW_FROM, SLOW_TO, STEPS = 20, 50, 90


def _node_groups(env: dict[str, str], shifts: dict[int, float]) -> list[subprocess.Popen]:
    """Two torchrun node groups of two ranks (as harness.start_job), node N's records
    stamped ``shifts[N]`` s off."""
    port, procs = free_port(), []
    for node in range(2):
        node_env = {**os.environ, **env, "COMMCHECK_HOST": f"node{node}",
                    "PYTHONUNBUFFERED": "1"}
        if node in shifts:
            node_env["COMMCHECK_TEST_CLOCK_SHIFT"] = repr(shifts[node])
        cmd = [str(BIN / "torchrun"), "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
               str(SCRIPT)]
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
        _started.append(procs[-1])
    return procs


def _stragglers_in(db) -> list[tuple]:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute("SELECT culprits FROM findings WHERE kind = 'straggler'"
                                ).fetchall()
    except sqlite3.Error:
        return []


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """The job run to its end: (report, seconds from the onset to the finding in the db)."""
    tmp = tmp_path_factory.mktemp("straggler")
    col = start_collector(tmp, 4, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "STRAG_RANK": "3", "STRAG_STEPS": str(STEPS),
           "STRAG_FROM": str(SLOW_FROM), "STRAG_TO": str(SLOW_TO), "STRAG_EXTRA": "0.1",
           "STRAG_MARK": str(tmp)}
    procs = _node_groups(env, {1: 3.0})
    seen = None
    while any(p.poll() is None for p in procs):
        if seen is None and _stragglers_in(col.db):
            seen = time.time()
        time.sleep(0.1)
    for p in procs:
        assert p.returncode == 0, p.communicate()[0][-2000:]
    assert col.wait()[0] == 1  # findings: the straggler
    onset = float((tmp / "onset").read_text())
    (tmp / "latency").write_text(f"{(seen or time.time()) - onset:.2f}\n")  # for the record
    return report_json(col.db)[1], (seen or time.time()) - onset, col.db


@pytest.mark.timeout(180)
def test_the_slowed_rank_is_named_with_its_host_and_onset_within_30_s(slowed):
    report, latency, _ = slowed
    [f] = report["findings"]  # nobody else: rank 2 shares node1's shifted clock
    d = f["detail"]
    assert (f["kind"], f["culprits"], f["hosts"]) == ("straggler", [3], ["node1"])
    assert (d["cause"], d["rank"], d["host"]) == ("rank", 3, "node1")
    assert SLOW_FROM <= d["start_step"] <= SLOW_FROM + 3 and f["step"] == d["start_step"]
    assert latency < 30, latency
    assert d["median_gap_ms"] > 40 and d["waiting_share"] >= 0.6
    assert "straggling.py" in d["waited_at"] and d["waited_at"] == f["callsite"]


@pytest.mark.timeout(180)
def test_its_episode_ends_when_the_slowdown_stops(slowed):
    d = slowed[0]["findings"][0]["detail"]
    assert d["ended"] and SLOW_TO <= d["end_step"] <= STEPS
    assert d["cost_s"] > 3 * (SLOW_TO - SLOW_FROM) * 4 * 0.02  # three others, >= 20 ms a call
    assert 30 < d["cost_pct"] <= 100


@pytest.mark.timeout(180)
def test_the_report_tables_put_the_slow_rank_and_host_first(slowed):
    report, _, db = slowed
    rank, host = report["summary"]["lateness"][0], report["summary"]["lateness_by_host"][0]
    assert (rank["rank"], rank["host"], host["host"], host["ranks"]) == (3, "node1", "node1",
                                                                       [2, 3])
    assert rank["median_gap_ms"] > 40  # by time: it is late to one call of four
    assert rank["collectives"] == STEPS * 4 and rank["cost_s"] > 3 * \
        max(r["cost_s"] for r in report["summary"]["lateness"][1:])
    text = subprocess.run([str(BIN / "python"), "-m", "commcheck", "report", str(db)],
                          capture_output=True, text=True, timeout=60).stdout
    assert "lateness per rank" in text and "rank 3 arrived last in" in text


@pytest.mark.timeout(120)
def test_a_pipelines_stage_skew_is_no_straggler(tmp_path):
    col = start_collector(tmp_path, 2, "--exit-when-done")
    for r in run_job(SCRIPT, {"COMMCHECK_COLLECTOR": col.endpoint, "STRAG_PIPELINE": "1",
                              "STRAG_STEPS": "60"}, nnodes=1, nproc=2):
        assert r.returncode == 0, r.stdout[-2000:]
    assert col.wait()[0] == 0
    report = report_json(col.db)[1]
    assert report["findings"] == []
    late = {r["rank"]: r for r in report["summary"]["lateness"]}
    assert late[0]["last"] >= 55  # stage 0 was last at every loss all_reduce: by design
