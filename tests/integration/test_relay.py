"""Records outlive the process that wrote them (issue 12): real torchrun jobs of gloo
ranks, each writing its ring in a private ring directory, the relays they start, a real
collector.

* a rank SIGKILLed right after a collective: every record it wrote reaches the database;
* two simulated nodes: one relay each; the one of node 1 SIGKILLed mid-run is started
  again by its ranks and re-sends from its journal: no record lost, none stored twice.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from commcheck.collector.store import Store
from commcheck.wire.ring import R_PID, Ring, RingError

from ..harness import WORKERS, report_json, run_job, start_collector
from ..stored import stored
from .test_delivery import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def rank_records(db: Path, rank: int) -> dict[int, int]:
    """phase (0 complete, 1 entry) -> records of ``rank`` in the database."""
    with stored(db) as conn:
        rows = conn.execute("SELECT t_done > 0, COUNT(*) FROM records WHERE rank = ? "
                            "GROUP BY t_done > 0", (rank,)).fetchall()
    return {1 - int(done): n for done, n in rows}


def statuses(db: Path) -> dict[int, dict]:
    store = Store.open(db)
    try:
        return {s["rank"]: s for s in store.statuses()}
    finally:
        store.conn.close()


def test_a_rank_killed_right_after_a_collective_loses_no_record(killed_rank_job):
    """The job of test_dying's rank_died case (conftest.py): rank 2 SIGKILLed right after
    its 7th all_reduce."""
    kill_at = 7
    r, (rc, out, err), db, rings = killed_rank_job
    assert r.returncode != 0  # torchrun reports the killed rank
    wait_for(lambda: rank_records(db, 2).get(0, 0) >= kill_at, 30,
             "rank 2's last completion record")
    wait_for(lambda: statuses(db).get(2, {}).get("state") == "gone", 30,
             "the relay's word that rank 2 is gone")
    # what rank 2 wrote before SIGKILL: an entry and a completion record per call
    assert rank_records(db, 2) == {1: kill_at, 0: kill_at}, err[-2000:]
    seen = statuses(db)
    assert seen[2]["state"] == "gone" and not seen[2]["goodbye"]
    assert seen[2]["records"] == 2 * kill_at and seen[2]["dropped"] == 0
    code, doc = report_json(db)
    assert doc["summary"]["dropped_on_ranks"] == 0
    assert not list(rings.glob("*.ring"))  # delivered: nothing left behind


def _relay_pids(ring_dir: Path, node: int) -> set[int]:
    pids = set()
    for path in ring_dir.glob(f"*-n{node}-r*.ring"):
        try:
            ring = Ring.open(str(path), writable=False)
        except (OSError, RingError):
            continue
        pids.add(ring.word(R_PID))
        ring.close()
    return pids - {0}


def test_two_nodes_two_relays_and_a_relay_killed_mid_run_loses_nothing(tmp_path):
    steps = 100
    rings = tmp_path / "rings"
    col = start_collector(tmp_path, 4, "--exit-when-done", "--hang-timeout", "600")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": "relaykill",
           "COMMCHECK_RING_DIR": str(rings), "COMMCHECK_ACK_TIMEOUT": "0.5",
           "COMMCHECK_LINGER": "60", "WORKER_STEPS": str(steps), "WORKER_SLEEP": "0.04"}
    results: list = []
    job = threading.Thread(target=lambda: results.extend(run_job(WORKERS / "steady.py", env)))
    job.start()
    try:
        wait_for(lambda: _relay_pids(rings, 1), 120, "node 1's relay")
        time.sleep(1.0)  # mid-run
        (victim,) = _relay_pids(rings, 1)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: _relay_pids(rings, 1) - {victim}, 30, "a new relay for node 1")
    finally:
        job.join(timeout=240)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    rc, out, err = col.wait(60)
    assert rc == 0, err[-3000:]
    want = 4 * steps * 3 * 2  # an entry and a completion record per call
    with stored(col.db) as conn:
        n = conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        distinct = conn.execute("SELECT COUNT(*) FROM (SELECT DISTINCT run, rank, grp, seq, "
                                "t_done > 0 FROM records)").fetchone()[0]
    assert n == distinct == want  # every record, exactly once
    code, doc = report_json(col.db)
    assert code == 0 and doc["summary"]["ranks_said_goodbye"] == 4
    assert doc["summary"]["dropped_on_ranks"] == 0 and doc["summary"]["unmatched"] == 0
    seen = statuses(col.db)
    relay_of = {rank: (s["relay_pid"], s["node"]) for rank, s in seen.items()}
    assert relay_of[0] == relay_of[1] and relay_of[2] == relay_of[3]  # one relay a node
    assert relay_of[0][0] != relay_of[2][0] and {relay_of[0][1], relay_of[2][1]} == {0, 1}
    assert victim not in {p for p, _ in relay_of.values()}
    assert not list(rings.glob("*.ring"))
