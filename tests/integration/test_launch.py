"""``commcheck run`` on two simulated nodes and the SLURM example, on loopback: two
invocations (``--nnodes 2 --node-rank {0,1}``) of 2 ranks each, real torchrun, relay and
collector.

What must hold, also when a node's training process dies: node 0 starts the collector
before torchrun and stops it after torchrun, the report is printed exactly once, and the
failing node's ``commcheck run`` exits non-zero.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from commcheck.wire.keys import keygen

from ..harness import BIN, ROOT, WORKERS, free_port
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SBATCH = ROOT / "launch" / "examples" / "commcheck.sbatch"
JOB = WORKERS / "launched.py"
REPORT_HEAD = "commcheck report:"


def _ports() -> tuple[int, int]:
    a = free_port()
    b = free_port()
    while b == a:
        b = free_port()
    return a, b


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
            "COMMCHECK_RUN_ID": "launch-test", **extra}


def _run_nodes(tmp: Path, fail: str = "") -> list[subprocess.CompletedProcess]:
    master, collector = _ports()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "commcheck", "run", "--nnodes", "2", "--node-rank",
               str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(master), "--collector-port", str(collector), "--db",
               str(tmp / "run.db"), "--stop-timeout", "5", "--", str(JOB)]
        env = _env(COMMCHECK_HOST=f"node{node}", LAUNCH_FAIL=fail)
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _order(text: str, *needles: str) -> list[int]:
    return [text.index(n) for n in needles]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _ranks(db: Path) -> list[tuple[int, str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT rank, host FROM ranks ORDER BY rank").fetchall()


@pytest.mark.parametrize("fail, victim_node", [("kill:2", 1), ("exit:0", 0)],
                         ids=["node1-rank-killed", "node0-rank-exits-3"])
def test_node_failure_keeps_the_collector_lifecycle(tmp_path, fail, victim_node):
    node0, node1 = _run_nodes(tmp_path, fail)
    both = [node0, node1]
    assert both[victim_node].returncode != 0, both[victim_node].stderr[-3000:]
    assert node0.returncode != 0  # the job failed, whichever node it failed on
    log = node0.stderr
    listen, start, exited, stopped = _order(
        log, "collector pid", "commcheck run: starting", "torchrun exited with status",
        "stopped (status")
    assert listen < start < exited < stopped, log
    pid = int(re.search(r"collector pid (\d+) listening", log).group(1))
    assert _gone(pid)
    texts = [t for r in both for t in (r.stdout, r.stderr)]
    assert sum(t.count(REPORT_HEAD) for t in texts) == 1
    assert REPORT_HEAD in node0.stdout
    assert "collector pid" not in node1.stderr
    assert [r for r, _ in _ranks(tmp_path / "run.db")] == [0, 1, 2, 3]


def test_sbatch_example_runs_two_nodes_with_curve(tmp_path):
    """launch/examples/commcheck.sbatch under a stand-in srun that starts one task per node here."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (fake / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n"
        "for ((i = 0; i < SLURM_NNODES; i++)); do\n"
        "  SLURM_NODEID=$i COMMCHECK_HOST=node$i \"$@\" & pids+=($!)\ndone\n"
        "rc=0\nfor p in \"${pids[@]}\"; do wait \"$p\" || rc=$?; done\nexit $rc\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    keygen(tmp_path / "keys")
    master, collector = _ports()
    env = _env(PATH=f"{fake}:{BIN}:{os.environ['PATH']}", SLURM_NNODES="2",
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="n[0-1]", SLURM_SUBMIT_DIR=str(ROOT),
               GPUS_PER_NODE="2", MASTER_PORT=str(master), COLLECTOR_PORT=str(collector),
               COMMCHECK_CURVE_DIR=str(tmp_path / "keys"),
               COMMCHECK_RUN_ARGS="--stop-timeout 30")
    r = subprocess.run(["bash", str(SBATCH), str(JOB)], env=env, cwd=tmp_path, text=True,
                       capture_output=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (r.stdout + r.stderr).count(REPORT_HEAD) == 1
    assert "no findings" in r.stdout
    assert "rejected" not in r.stdout + r.stderr
    db = tmp_path / "runs" / "commcheck-4242.db"
    assert _ranks(db) == [(0, "node0"), (1, "node0"), (2, "node1"), (3, "node1")]
    with stored(db) as conn:
        runs = conn.execute("SELECT DISTINCT run FROM records").fetchall()
        goodbyes = conn.execute("SELECT SUM(goodbye) FROM ranks").fetchone()[0]
    assert runs == [("slurm-4242",)]
    assert goodbyes == 4
