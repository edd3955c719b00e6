"""How fast a backlog drains once a late collector answers (issue 18; README, Collector).

Two simulated nodes of ``--nproc`` gloo ranks each run ``--steps`` steps of
``tests/workers/steady.py`` with no collector (each rank's records wait in its ring, the
ranks then wait up to their linger for the acks); the collector starts ``--late`` seconds
after the last rank finished its steps. Prints the backlog, when it was stored (the
database's record count sampled every 0.25 s), and when the collector closed the run
(every goodbye acknowledged)::

    PYTHONPATH=. python launch/bench/bench_drain.py --steps 1000
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.harness import (  # noqa: E402
    WORKERS,
    free_port,
    reap,
    report_json,
    start_collector,
    start_job,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--late", type=float, default=3.0)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="commcheck-drain-"))
    port = free_port()
    env = {"COMMCHECK_COLLECTOR": f"tcp://127.0.0.1:{port}",
           "COMMCHECK_RUN_ID": f"drain{time.time_ns()}",
           "COMMCHECK_RING_DIR": str(tmp / "rings"), "COMMCHECK_LINGER": "120",
           "WORKER_STEPS": str(a.steps), "WORKER_SLEEP": "0", "WORKER_TIMES": str(tmp)}
    try:
        procs = start_job(WORKERS / "steady.py", env, nnodes=2, nproc=a.nproc)
        while len(list(tmp.glob("rank*.txt"))) < 2 * a.nproc:  # every rank did its steps
            time.sleep(0.2)
        time.sleep(a.late)
        col = start_collector(tmp, 2 * a.nproc, "--exit-when-done", port=port)
        t0 = time.monotonic()
        samples: list[tuple[float, int]] = []

        def sample() -> None:
            while col.proc.poll() is None:
                try:
                    with sqlite3.connect(f"file:{col.db}?mode=ro", uri=True, timeout=1) as c:
                        n = c.execute("SELECT COUNT(*) FROM records").fetchone()[0]
                    samples.append((time.monotonic() - t0, n))
                except sqlite3.Error:
                    pass
                time.sleep(0.25)

        th = threading.Thread(target=sample)
        th.start()
        col.wait(600)
        closed = time.monotonic() - t0
        th.join()
        for p in procs:
            p.communicate(timeout=120)
        _, doc = report_json(col.db)
        s = doc["summary"]
        total = s["records"]
        stored = next((t for t, n in samples if n >= total), closed)
        print(json.dumps({"backlog_records": total, "dropped": s["dropped_on_ranks"],
                          "stored_s": round(stored, 2), "closed_s": round(closed, 2),
                          "records_per_s": round(total / stored)}))
    finally:
        reap()


if __name__ == "__main__":
    main()
