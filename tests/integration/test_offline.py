"""The offline path: the same faulty job, once live and once dumped, gives the same findings.

The live run is test_spine's faulty job (the ``mixed_faults_live`` fixture); the dumped
run is made once here and serves the damaged-dump case too."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from ..harness import WORKERS, commcheck_cmd, report_json, run_job
from .test_spine import FAULTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _key(f: dict) -> tuple:
    return (f["kind"], f["op"], f["group"], f["seq"], f["step"], tuple(f["culprits"]),
            tuple(f["hosts"]), f["callsite"], f["ambiguous"])


@pytest.fixture(scope="module")
def live(mixed_faults_live) -> tuple[int, dict, str]:
    """(collector status, report, run id) of the live faulty run."""
    rc, _, _, db = mixed_faults_live
    _, doc = report_json(db)
    return rc, doc, db.parent.name


@pytest.fixture(scope="module")
def dumped(live, tmp_path_factory):
    """The same faulty job, same run id, dumped to files: the run's dump folder."""
    run = live[2]
    dump_dir = tmp_path_factory.mktemp("dump")
    env = {"COMMCHECK_RUN_ID": run, "COMMCHECK_INJECT": ";".join(f[0] for f in FAULTS),
           "COMMCHECK_DUMP_DIR": str(dump_dir)}
    for r in run_job(WORKERS / "mixed.py", env):
        assert r.returncode == 0, r.stdout[-2000:]
    return dump_dir / run


def test_live_and_dumped_runs_give_equal_findings(live, dumped, tmp_path):
    rc, live_doc, _ = live
    assert rc == 1
    files = sorted(p.name for p in dumped.iterdir())
    assert files == [f"rank{r:05d}.ccw" for r in range(4)]
    db = tmp_path / "offline.db"
    r = subprocess.run(commcheck_cmd("analyze", str(dumped.parent), "--db", str(db), "--json"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    offline = json.loads(r.stdout)
    assert len(live_doc["findings"]) == len(FAULTS)
    assert sorted(map(_key, offline["findings"])) == sorted(map(_key, live_doc["findings"]))
    assert offline["summary"]["verified"] == live_doc["summary"]["verified"] == 240
    assert report_json(db)[1]["findings"] == offline["findings"]


def test_analyze_counts_a_damaged_dump_and_keeps_the_rest(dumped, tmp_path):
    run = tmp_path / "dump"
    shutil.copytree(dumped, run / dumped.name)
    victim = run / dumped.name / "rank00003.ccw"
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
