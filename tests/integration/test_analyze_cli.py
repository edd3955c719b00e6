"""``commcheck analyze`` as installed, and over what a SIGKILLed collector left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from ..harness import WORKERS, commcheck_cmd, free_port, run_job, start_collector
from ..stored import stored
from ..unit import test_analyze_sources as merged
from ..unit.test_analyze_sources import N_RECORDS, OVERLAPS, WORLD, _delivered, _stored

sources = merged.sources  # the fixture of the in-process tests


def test_the_installed_entry_point_merges_too(sources):
    r = subprocess.run(commcheck_cmd("analyze", str(sources["db"]), str(sources["spill"]),
                                     str(sources["ccw"])), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"{OVERLAPS} messages rejected (duplicate)" in r.stdout
    assert f"{N_RECORDS} records from {WORLD} ranks" in r.stdout

@pytest.mark.integration
@pytest.mark.timeout(120)
def test_collector_killed_for_good_db_plus_spills_hold_every_record(tmp_path):
    steps, world = 100, 2  # ~5 s of calls: the kill lands mid-run even when commits come late
    spill_dir, db = tmp_path / "spill", tmp_path / "run.db"
    col = start_collector(tmp_path, world, "--hang-timeout", "600", port=free_port(), db=db)
    env = {**os.environ, "COMMCHECK_RUN_ID": "gone", "COMMCHECK_COLLECTOR": col.endpoint,
           "COMMCHECK_SPILL_DIR": str(spill_dir), "COMMCHECK_BUFFER_BYTES": "20000",
           "COMMCHECK_ACK_TIMEOUT": "0.5", "COMMCHECK_LINGER": "2",
           "WORKER_STEPS": str(steps), "WORKER_SLEEP": "0.05"}
    results: list = []
    job = threading.Thread(target=lambda: results.extend(
        run_job(WORKERS / "steady.py", env, nnodes=1, nproc=world, timeout=90)))
    job.start()
    try:
        deadline = time.monotonic() + 60
        while _delivered(db) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        col.proc.send_signal(signal.SIGKILL)
        col.proc.wait(10)
    finally:
        job.join(timeout=100)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    at_kill = _delivered(db)
    spills = sorted(spill_dir.rglob("*.spill"))
    assert at_kill > 0 and len(spills) == world, (at_kill, spills)
    want = world * steps * 3 * 2  # entry + complete record per call
    with stored(db) as conn:
        in_db = conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
    assert 0 < in_db < want, "the kill did not land mid-run"
    out = tmp_path / "merged.db"
    r = subprocess.run(commcheck_cmd("analyze", str(db), str(spill_dir), "--db", str(out),
                                     "--json"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["summary"]["records"] == want
    assert _stored(out) == (want, want)  # every record (entry and complete) once
    assert doc["summary"]["verified"] == steps * 3
    assert doc["summary"]["ranks_said_goodbye"] == world and doc["findings"] == []
    assert set(doc["summary"]["rejected"]) <= {"duplicate"}
