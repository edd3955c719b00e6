"""Acknowledged, exactly-once delivery: the collector killed with SIGKILL mid-run and
restarted on the same database and port loses nothing and stores nothing twice.

Real parts: ``commcheck collect`` subprocesses on a fixed loopback port, a rank-side ring
written in this process and the relay process it starts (its real DEALER socket), and a
torchrun job of 4 gloo ranks.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from commcheck.collector.store import Store, StoreError
from commcheck.rank.ring import RingWriter
from commcheck.rank.session import _Ready
from commcheck.wire.relay_settings import RelaySettings
from commcheck.wire.ring import R_HELD, Identity

from ..harness import WORKERS, free_port, report_json, run_job, start_collector
from ..records import rec
from ..stored import stored

pytestmark = [pytest.mark.integration]

STEADY = WORKERS / "steady.py"


def collector(tmp: Path, port: int, world: int, db: Path, *extra: str) -> subprocess.Popen:
    """``commcheck collect`` on a fixed port (so a restart takes the same one)."""
    return start_collector(tmp, world, "--hang-timeout", "600", *extra, port=port,
                           db=db).proc


def committed_records(db: Path) -> int:
    try:
        store = Store.open(db)
        try:
            return store.summary().records
        finally:
            store.close()
    except (sqlite3.Error, StoreError):
        return 0


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def sender(endpoint: str, run: str, ring_dir: Path, buffer_bytes: int = 4 << 20,
           spill_dir: str = "", ring_bytes: int = 8 << 20, linger: float = 30) -> RingWriter:
    """This process as rank 0 of a one-rank run: its ring in ``ring_dir``, and the relay it
    starts (a real process, detached, as a rank starts it) shipping to ``endpoint``."""
    ident = Identity(run=run, rank=0, host="testhost", world=1, node=-1, pid=os.getpid(),
                     dest=endpoint)
    relay = RelaySettings(run=run, collector=endpoint, spill_dir=spill_dir,
                          spill_bytes=64 << 20, buffer_bytes=buffer_bytes, ack_timeout=0.5,
                          batch_records=50, flush_interval=0.02, linger=linger)
    s = RingWriter.create(str(ring_dir), ident, ring_bytes, relay, queue_records=1 << 20)
    s.start()
    return s


def submit(s: RingWriter, start: int, n: int) -> float:
    """Submit records ``start..start+n``; return the longest submit() call, in seconds."""
    worst = 0.0
    for i in range(start, start + n):
        t0 = time.perf_counter()
        s.submit(_Ready(rec(seq=i, ranks=(0,), callsite=f"d.py:{i} main")))
        worst = max(worst, time.perf_counter() - t0)
    return worst


def stored_seqs(db: Path, run: str) -> list[int]:
    with stored(db) as conn:
        return [s for (s,) in conn.execute("SELECT seq FROM records WHERE run = ? "
                                           "ORDER BY seq", (run,))]


# -- units ----------------------------------------------------------------------------------



# -- a real collector killed and restarted ---------------------------------------------------


@pytest.mark.timeout(120)
def test_sender_loses_nothing_across_collector_kill9(tmp_path):
    port, db = free_port(), tmp_path / "run.db"
    col = collector(tmp_path, port, 1, db, "--exit-when-done")
    s = sender(f"tcp://127.0.0.1:{port}", "kill9", tmp_path / "rings")
    worst = submit(s, 0, 1500)
    wait_for(lambda: committed_records(db) > 0, 30, "the first commit")
    col.send_signal(signal.SIGKILL)
    col.wait(10)
    worst = max(worst, submit(s, 1500, 1500))  # the collector is gone
    wait_for(lambda: s.ring.word(R_HELD) > 0, 10, "batches held for the dead collector")
    col = collector(tmp_path, port, 1, db, "--exit-when-done")
    worst = max(worst, submit(s, 3000, 1000))
    s.close(linger=30)
    out, err = col.communicate(timeout=60)
    assert col.returncode == 0, err
    assert stored_seqs(db, "kill9") == list(range(4000))  # every record, exactly once
    assert worst < 0.5, f"submit() took {worst:.3f} s"  # a copy into memory, never I/O
    code, doc = report_json(db)
    assert code == 0 and doc["summary"]["verified"] == 4000
    assert doc["summary"]["dropped_on_ranks"] == 0


@pytest.mark.timeout(300)
def test_torchrun_job_survives_collector_kill9_with_same_findings(tmp_path):
    inject = "bitflip:rank=2,op=all_reduce,call=60,bit=3"
    env = {"COMMCHECK_RUN_ID": "steady", "COMMCHECK_INJECT": inject,
           "COMMCHECK_LINGER": "60", "COMMCHECK_ACK_TIMEOUT": "0.5",
           "WORKER_STEPS": "100", "WORKER_SLEEP": "0.04"}

    def findings(db: Path) -> list[tuple]:
        code, doc = report_json(db)
        assert code == 1, doc
        return sorted((f["kind"], f["op"], f["group"], f["seq"], tuple(f["culprits"]),
                       f["step"]) for f in doc["findings"])

    # what an undisturbed run finds (steady.py: all_reduce, all_gather, broadcast per step;
    # the 60th all_reduce is step 59, seq 177), and every record of it
    want = [("value_mismatch", "all_reduce", "0[0-3]", 177, (2,), 59)]
    n_want = 4 * 100 * 3 * 2  # entry + complete record per call

    # kill -9 mid-run, restart on the same DB and port
    (tmp_path / "b").mkdir()
    port, db = free_port(), tmp_path / "b" / "run.db"
    col = collector(tmp_path / "b", port, 4, db, "--exit-when-done")
    job_env = {**os.environ, **env, "COMMCHECK_COLLECTOR": f"tcp://127.0.0.1:{port}"}
    import threading

    results: list = []
    job = threading.Thread(target=lambda: results.extend(run_job(STEADY, job_env)))
    job.start()
    try:
        wait_for(lambda: committed_records(db) > 0, 120, "the first commit")
        col.send_signal(signal.SIGKILL)
        col.wait(10)
        at_kill = committed_records(db)
        time.sleep(1.5)
        col = collector(tmp_path / "b", port, 4, db, "--exit-when-done")
    finally:
        job.join(timeout=240)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    out, err = col.communicate(timeout=60)
    assert 0 < at_kill < n_want, "the kill did not land mid-run"
    with stored(db) as conn:
        n = conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        distinct = conn.execute("SELECT COUNT(*) FROM (SELECT DISTINCT run, rank, grp, seq, "
                                "t_done > 0 FROM records)").fetchone()[0]
        bodies = conn.execute("SELECT COUNT(body) FROM delivered").fetchone()[0]
        snapshots = conn.execute("SELECT COUNT(*) FROM snapshot").fetchone()[0]
    assert n == distinct == n_want  # every record, exactly once
    assert bodies == 0 and snapshots == 1  # the restart continued from the engine's state
    assert findings(db) == want
    code, doc = report_json(db)
    assert doc["summary"]["ranks_said_goodbye"] == 4 and doc["summary"]["unmatched"] == 0
    assert doc["summary"]["dropped_on_ranks"] == 0
