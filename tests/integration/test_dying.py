"""A rank that dies, freezes or aborts, and a job that crashes at start-up (issue 12): real
torchrun jobs of 4 gloo ranks, their relay, a real collector. Each gives one finding that
names the rank and the true place, and a report that does not read clean."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from ..harness import (
    WORKERS,
    commcheck_cmd,
    report_json,
    run_job,
    start_collector,
    start_job,
)
from .test_delivery import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

DYING = WORKERS / "dying.py"


def _env(col, tmp_path: Path, run: str, **extra: str) -> dict[str, str]:
    return {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": run,
            "COMMCHECK_RING_DIR": str(tmp_path / "rings"), **extra}


def _kinds(db: Path) -> list[tuple[str, list[int]]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
        return [(k, json.loads(c)) for k, c in conn.execute("SELECT kind, culprits FROM findings")]


def _kill_workers(db: Path) -> None:
    """SIGKILL every rank process the relays reported (a stopped one would stay forever,
    and its relay with it)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        pids = [pid for (pid,) in conn.execute("SELECT pid FROM rank_status") if pid > 0]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_rank_killed_after_a_collective_is_one_rank_died(killed_rank_job):
    """Rank 2 SIGKILLed right after its 7th all_reduce; torchrun then stops the others,
    blocked in the 8th. One rank_died naming rank 2 and its last completed call; no
    missing_rank; the collector exits by itself (every rank said goodbye or died). The job
    is test_relay's too (conftest.py)."""
    job, (rc, out, err), db, _ = killed_rank_job
    assert job.returncode != 0
    assert rc == 3, out[-3000:] + err[-2000:]  # a run that did not finish
    code, doc = report_json(db)
    assert code == 3
    died = [f for f in doc["findings"] if f["kind"] == "rank_died"]
    assert [f["culprits"] for f in died] == [[2]], doc["findings"]
    assert not [f for f in doc["findings"] if f["kind"] in ("missing_rank", "hang")]
    d = died[0]["detail"]
    assert d["last_completed"]["at"].endswith("seq 6")  # the 7th all_reduce: seq 6
    assert "last_entered" not in d
    # the others end as torchrun stops them: a SIGTERM (no goodbye: named here, no finding
    # of its own) or an error from the broken connection (a goodbye)
    assert set(d.get("then_gone", [])) <= {0, 1, 3}
    assert {u["rank"] for u in doc["summary"]["unfinished"]} >= {2}


def test_ranks_torchrun_stops_between_calls_are_the_killed_ranks_consequences(tmp_path):
    """Rank 2 is SIGKILLed after its 7th all_reduce while the others sleep (a forward pass):
    torchrun SIGTERMs them outside any collective. Their handler wrote the signal into their
    rings, so one rank_died names rank 2 with the others as then_gone, not four deaths: on
    ranks 0 and 1 commcheck's own handler, on rank 3 behind the job's own Python SIGTERM
    handler set after patch() (put back in front). One job for both handlers."""
    col = start_collector(tmp_path, 4, "--hang-timeout", "5", "--exit-when-done")
    (job,) = run_job(WORKERS / "killed.py", _env(col, tmp_path, "stopped", KILL_AT="7",
                                                 OTHERS_SLEEP="60", PY_SIGTERM="exit:3"),
                     nnodes=1, nproc=4)
    assert job.returncode != 0
    rc, out, err = col.wait(60)
    code, doc = report_json(col.db)
    assert rc == code == 3, out[-3000:] + err[-2000:]
    died = [f for f in doc["findings"] if f["kind"] == "rank_died"]
    assert [f["culprits"] for f in died] == [[2]], doc["findings"]
    assert died[0]["detail"].get("signal") in (None, 9)  # 9 if the relay saw its zombie
    assert died[0]["detail"]["then_gone"] == [0, 1, 3]
    assert not [f for f in doc["findings"] if f["kind"] in ("missing_rank", "hang")]


def _signal_workers(db: Path, sig: int, ranks: set[int]) -> None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        pids = [pid for rank, pid in conn.execute("SELECT rank, pid FROM rank_status")
                if rank in ranks and pid > 0]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _hang_detail(db: Path) -> dict:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        return json.loads(conn.execute("SELECT detail FROM findings WHERE kind = 'hang'"
                                       ).fetchone()[0])


def test_a_rank_stopped_inside_a_collective_is_a_live_hang_naming_it(tmp_path):
    """Every member entered the 5th all_reduce; rank 1 was SIGSTOPped inside it. The
    collector (hang timeout 3 s) reports a hang naming rank 1 while the job still hangs.
    Then the job is torn down as a launcher does it (issue 29 part 3): SIGTERM to every
    rank at once, SIGKILL to the frozen one after the grace period. No rank_died: the hang
    names them all as its consequences, and no rank is the cause of another."""
    col = start_collector(tmp_path, 4, "--hang-timeout", "3")
    procs = start_job(DYING, _env(col, tmp_path, "stopped", DYING="stop", VICTIM="1",
                                  AT="4"), nnodes=1, nproc=4)
    try:
        wait_for(lambda: any(k == "hang" for k, _ in _kinds(col.db)), 40,
                 "a live hang finding")
        assert [c for k, c in _kinds(col.db) if k == "hang"] == [[1]]
        _signal_workers(col.db, signal.SIGTERM, {0, 1, 2, 3})
        _signal_workers(col.db, signal.SIGKILL, {1})
        wait_for(lambda: _hang_detail(col.db).get("then_gone") == [0, 1, 2, 3], 30,
                 "the teardown named in the hang")
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        _kill_workers(col.db)  # torchrun's workers are not in its process group
    rc, _, err = col.terminate()
    assert rc == 3, err
    code, doc = report_json(col.db)
    assert [f["kind"] for f in doc["findings"]] == ["hang"], doc["findings"]
    [hang] = doc["findings"]
    assert (hang["op"], hang["seq"], hang["ambiguous"]) == ("all_reduce", 4, False)
    text = subprocess.run(commcheck_cmd("report", str(col.db)), capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "400"}).stdout
    assert "; then ranks 0-3 gone (torn down after it: its consequences)" in text, text


def test_an_abort_on_a_size_mismatch_is_a_desync_naming_the_rank(tmp_path):
    """Rank 3 calls all_reduce with 999 elements where the others use 1000 and aborts
    (SIGABRT) inside it: its entry record was already in its ring, so the desync is found."""
    col = start_collector(tmp_path, 4, "--hang-timeout", "5", "--exit-when-done")
    (job,) = run_job(DYING, _env(col, tmp_path, "aborted", DYING="abort", VICTIM="3",
                                 AT="4"), nnodes=1, nproc=4)
    assert job.returncode != 0
    rc, out, err = col.wait(60)
    code, doc = report_json(col.db)
    desync = [f for f in doc["findings"] if f["kind"] == "desync"]
    assert [(f["culprits"], f["seq"]) for f in desync] == [([3], 4)], doc["findings"]
    assert "numel_in" in desync[0]["detail"]["fields"]
    assert rc == code == 3  # rank 3 never said goodbye


def test_a_job_that_crashed_at_start_up_never_reads_clean(tmp_path):
    """Every rank raises after init_process_group: each still says goodbye (the exception
    runs the exit handlers), and the goodbye says how it ended (issue 29 part 1): training
    failed, status 4, from the collector and from report."""
    col = start_collector(tmp_path, 4, "--hang-timeout", "5", "--exit-when-done")
    (job,) = run_job(DYING, _env(col, tmp_path, "crashed", DYING="crash"), nnodes=1, nproc=4)
    assert job.returncode != 0
    rc, out, _ = col.wait(60)
    failed = ("training failed on ranks 0-3: RuntimeError: rank 0: bad config, giving up "
              "before training (rank 0's; alike for the others)")
    assert rc == 4, out
    assert failed in out and "connected but recorded no collective" in out, out
    code, doc = report_json(col.db)
    assert code == 4 and doc["summary"]["ranks_said_goodbye"] == 4
    assert doc["summary"]["failed"] == [{
        "ranks": [0, 1, 2, 3], "how": "exception",
        "error": "RuntimeError: rank 0: bad config, giving up before training", "alike": True}]


def test_survivors_of_a_killed_rank_are_crashed_with_their_error(tmp_path):
    """Rank 2 of 3 is SIGKILLed while ranks 0,1 wait for it in the 5th all_reduce: their
    gloo all_reduce raises on the closed connection. rank_died names rank 2 and says the
    survivors crashed there with the error they raised (issue 18 item 5), not "wait"."""
    col = start_collector(tmp_path, 3, "--hang-timeout", "5", "--exit-when-done")
    (job,) = run_job(DYING, _env(col, tmp_path, "survived", DYING="kill", VICTIM="2",
                                 AT="4"), nnodes=1, nproc=3)
    assert job.returncode != 0
    col.wait(60)
    code, doc = report_json(col.db)
    [died] = [f for f in doc["findings"] if f["kind"] == "rank_died"]
    assert died["culprits"] == [2], doc["findings"]
    [w] = died["detail"]["waiting"]
    assert w["at"].endswith("seq 4") and w["ranks"] == [0, 1]
    crashed = w.get("crashed", {})
    assert crashed and set(crashed) <= {"0", "1"}, w  # torchrun may stop one first
    for error in crashed.values():
        assert error.startswith("RuntimeError: Connection closed by peer"), error
    assert not [f for f in doc["findings"] if f["kind"] in ("missing_rank", "hang")]
    text = subprocess.run(commcheck_cmd("report", str(col.db)), capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "400"}).stdout
    assert " crashed in all_reduce 0[0-2] seq 4: RuntimeError: Connection closed by peer" in \
        text, text
