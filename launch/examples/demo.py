"""`make demo`: a collector plus a 4-rank job on two simulated nodes, with one injected fault.

Starts `commcheck collect` on a loopback port, then two torchrun node groups (node0, node1;
two ranks each, gloo) running launch/examples/train_demo.py with a bit flip injected into one
gradient all_reduce on rank 2. The collector prints its report when every rank said
goodbye; the demo then checks that the report names rank 2 and exits 0 if it does.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "runs"
FAULT = "bitflip:rank=2,op=all_reduce,call=40,bit=30"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    RUNS.mkdir(exist_ok=True)
    db, ready = RUNS / "demo.db", RUNS / "demo.ready"
    for p in (db, ready, Path(f"{db}-wal"), Path(f"{db}-shm")):
        p.unlink(missing_ok=True)
    cli = [sys.executable, "-m", "commcheck.cli"]
    collector = subprocess.Popen([*cli, "collect", "--bind", "tcp://127.0.0.1:*",
                                  "--world-size", "4", "--db", str(db), "--exit-when-done",
                                  "--idle-timeout", "120", "--ready-file", str(ready)])
    while not ready.exists():
        if collector.poll() is not None:
            print("demo: the collector did not start", file=sys.stderr)
            return 1
        time.sleep(0.05)
    endpoint = ready.read_text().strip()
    port = free_port()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    print(f"demo: collector on {endpoint}; training 4 ranks on 2 simulated nodes with "
          f"COMMCHECK_INJECT={FAULT!r} (logs in runs/demo-node*.log)", flush=True)
    jobs = []
    for node in range(2):
        env = {**os.environ, "COMMCHECK_COLLECTOR": endpoint, "COMMCHECK_HOST": f"node{node}",
               "COMMCHECK_INJECT": FAULT, "COMMCHECK_RUN_ID": "demo",
               "PYTHONWARNINGS": "ignore"}
        log = open(RUNS / f"demo-node{node}.log", "w")  # noqa: SIM115 - closed below
        jobs.append((subprocess.Popen(
            [torchrun, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
             "--master-addr=127.0.0.1", f"--master-port={port}",
             str(ROOT / "launch" / "examples" / "train_demo.py"), "--steps", "30"],
            env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = False
    for proc, log in jobs:
        failed |= proc.wait() != 0
        log.close()
    collector.wait(timeout=60)
    if failed:
        print("demo: the training job failed; see runs/demo-node*.log", file=sys.stderr)
        return 1
    doc = json.loads(subprocess.run([*cli, "report", str(db), "--json"], capture_output=True,
                                    text=True).stdout)
    culprits = {r for f in doc["findings"] for r in f["culprits"]}
    if culprits == {2}:
        print("demo: commcheck named rank 2 (host node1), the rank whose all_reduce output "
              "was corrupted; full report: commcheck report runs/demo.db", flush=True)
        return 0
    print(f"demo: expected rank 2 to be named, got {sorted(culprits)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
