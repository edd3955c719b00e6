"""A run's fixed cost: ``commcheck run`` against plain ``torchrun`` on a tiny 2-rank job.

    python launch/bench/bench_startup.py [--pairs 5] [--steps 20] [--nproc 2] [--also NAME=DIR]

Each pair runs ``torchrun --standalone --nproc-per-node 2 tests/workers/unmodified.py
--steps 20`` once plainly and once under ``commcheck run`` (which order goes first
alternates from pair to pair), so the load of a shared box falls on both sides alike. Per
side: median wall time and median user+sys CPU of the whole process tree (``RUSAGE_
CHILDREN`` of the run), and the difference of the medians. The machine's load average is
printed before and after, since the figures mean little without it. ``PYTHONPATH`` decides
which commcheck runs (a checkout on it wins over the installed one); ``--also NAME=DIR``
adds a side that runs the checkout in DIR (``PYTHONPATH=DIR``) in the same rounds, so that
two versions are compared under the same load (the order of the sides rotates from round
to round). The databases go to a temporary directory removed at the end.
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


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float] | None:
    """(wall s, user+sys CPU s of every descendant) of one run; None, said, if it failed
    (a loaded box now and then aborts a gloo job, plain torchrun's as well)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no message"]
        print(f"  {cmd[2:4]} failed ({done.returncode}): {tail[0][:200]}; left out",
              flush=True)
        return None
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--also", action="append", default=[], metavar="NAME=DIR",
                    help="another commcheck checkout to run in the same rounds")
    args = ap.parse_args()
    job = ["--nproc-per-node", str(args.nproc), str(WORKER), "--steps", str(args.steps)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    envs = {"torchrun": env, "commcheck run": env}
    for also in args.also:
        name, _, where = also.partition("=")
        envs[f"commcheck run ({name})"] = {**env, "PYTHONPATH": str(Path(where).resolve())}
    width = max(map(len, envs))
    with tempfile.TemporaryDirectory(prefix="commcheck-bench-startup-") as tmp:
        def command(name: str, i: int) -> list[str]:
            if name == "torchrun":
                return [sys.executable, "-m", "torch.distributed.run", "--standalone", *job]
            return [sys.executable, "-m", "commcheck", "run", "--db",
                    f"{tmp}/run{i}-{list(envs).index(name)}.db", *job]

        got: dict[str, list[tuple[float, float]]] = {k: [] for k in envs}
        print(f"load average before: {load()} ({os.cpu_count()} cores)", flush=True)
        for i in range(args.pairs):
            order = list(envs)[i % len(envs):] + list(envs)[:i % len(envs)]
            for name in order if i % 2 == 0 else reversed(order):
                took = timed(command(name, i), envs[name])
                if took is None:
                    continue
                wall, cpu = took
                got[name].append((wall, cpu))
                print(f"round {i + 1}: {name:{width}} wall {wall:6.2f} s  cpu {cpu:6.2f} s",
                      flush=True)
        print(f"load average after: {load()}")
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for k, v in got.items()}
    for name, (w, c) in med.items():
        print(f"median {name:{width}} wall {w:6.2f} s  user+sys {c:6.2f} s")
    tw, tc = med["torchrun"]
    for name, (cw, cc) in med.items():
        if name != "torchrun":
            print(f"fixed cost of {name}: +{cw - tw:.2f} s wall, +{cc - tc:.2f} s CPU "
                  f"({args.pairs} rounds, {args.nproc} ranks, {args.steps} all-reduces)")


if __name__ == "__main__":
    main()
