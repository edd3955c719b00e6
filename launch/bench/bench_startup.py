"""A run's fixed cost: ``commcheck run`` against plain ``torchrun`` on a tiny 2-rank job.

    python launch/bench/bench_startup.py [--pairs 5] [--steps 20] [--nproc 2]

Each pair runs ``torchrun --standalone --nproc-per-node 2 tests/workers/unmodified.py
--steps 20`` once plainly and once under ``commcheck run`` (which order goes first
alternates from pair to pair), so the load of a shared box falls on both sides alike. Per
side: median wall time and median user+sys CPU of the whole process tree (``RUSAGE_
CHILDREN`` of the run), and the difference of the medians. The machine's load average is
printed before and after, since the figures mean little without it. ``PYTHONPATH`` decides
which commcheck runs (a checkout on it wins over the installed one); the databases go to a
temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "tests" / "workers" / "unmodified.py"


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, user+sys CPU s of every descendant) of one run, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"bench_startup: {cmd[2:4]} failed ({done.returncode}):\n"
                 f"{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    job = ["--nproc-per-node", str(args.nproc), str(WORKER), "--steps", str(args.steps)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="commcheck-bench-startup-") as tmp:
        sides = {
            "torchrun": lambda i: [sys.executable, "-m", "torch.distributed.run",
                                   "--standalone", *job],
            "commcheck run": lambda i: [sys.executable, "-m", "commcheck", "run", "--db",
                                        f"{tmp}/run{i}.db", *job]}
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        print(f"load average before: {load()} ({os.cpu_count()} cores)", flush=True)
        for i in range(args.pairs):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                wall, cpu = timed(sides[name](i), env)
                got[name].append((wall, cpu))
                print(f"pair {i + 1}: {name:13} wall {wall:6.2f} s  cpu {cpu:6.2f} s",
                      flush=True)
        print(f"load average after: {load()}")
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for k, v in got.items()}
    for name, (w, c) in med.items():
        print(f"median {name:13} wall {w:6.2f} s  user+sys {c:6.2f} s")
    (cw, cc), (tw, tc) = med["commcheck run"], med["torchrun"]
    print(f"fixed cost: +{cw - tw:.2f} s wall, +{cc - tc:.2f} s CPU "
          f"({args.pairs} pairs, {args.nproc} ranks, {args.steps} all-reduces)")


if __name__ == "__main__":
    main()
