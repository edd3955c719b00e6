"""The offline path: the same faulty job, once live and once dumped, gives the same findings."""

from __future__ import annotations

import json
import subprocess

import pytest

from ..harness import WORKERS, commcheck_cmd, report_json, run_job, start_collector
from .test_spine import FAULTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _key(f: dict) -> tuple:
    return (f["kind"], f["op"], f["group"], f["seq"], f["step"], tuple(f["culprits"]),
            tuple(f["hosts"]), f["callsite"], f["ambiguous"])


def test_live_and_dumped_runs_give_equal_findings(tmp_path):
    inject = ";".join(f[0] for f in FAULTS)
    env = {"COMMCHECK_RUN_ID": "same-run", "COMMCHECK_INJECT": inject}
    live_dir, dump_dir = tmp_path / "live", tmp_path / "dump"
    live_dir.mkdir()
    col = start_collector(live_dir, 4, "--exit-when-done")
    for r in run_job(WORKERS / "mixed.py", {**env, "COMMCHECK_COLLECTOR": col.endpoint}):
        assert r.returncode == 0, r.stdout[-2000:]
    assert col.wait()[0] == 1
    _, live = report_json(col.db)

    for r in run_job(WORKERS / "mixed.py", {**env, "COMMCHECK_DUMP_DIR": str(dump_dir)}):
        assert r.returncode == 0, r.stdout[-2000:]
    files = sorted(p.name for p in (dump_dir / "same-run").iterdir())
    assert files == [f"rank{r:05d}.ccw" for r in range(4)]
    db = tmp_path / "offline.db"
    r = subprocess.run(commcheck_cmd("analyze", str(dump_dir), "--db", str(db), "--json"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    offline = json.loads(r.stdout)
    assert len(live["findings"]) == len(FAULTS)
    assert sorted(map(_key, offline["findings"])) == sorted(map(_key, live["findings"]))
    assert offline["summary"]["verified"] == live["summary"]["verified"] == 240
    assert report_json(db)[1]["findings"] == offline["findings"]


def test_analyze_counts_a_damaged_dump_and_keeps_the_rest(tmp_path):
    run = tmp_path / "dump"
    for r in run_job(WORKERS / "mixed.py", {"COMMCHECK_DUMP_DIR": str(run),
                                            "COMMCHECK_RUN_ID": "cut", "WORKER_ITERS": "3"}):
        assert r.returncode == 0, r.stdout[-2000:]
    victim = run / "cut" / "rank00003.ccw"
    victim.write_bytes(victim.read_bytes()[:-7])
    r = subprocess.run(commcheck_cmd("analyze", str(run), "--json"), capture_output=True,
                       text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert doc["summary"]["rejected"] == {"truncated": 1}
    assert doc["summary"]["records"] > 0
    (tmp_path / "empty").mkdir()
    for bad, msg in [(tmp_path / "nothing", "no such file"),
                     (tmp_path / "empty", "no commcheck dump")]:
        r = subprocess.run(commcheck_cmd("analyze", str(bad)), capture_output=True, text=True)
        assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1
