"""How fast `commcheck trace` streams, and that its memory does not grow with the run: a
synthetic database of RANKS ranks × STEPS steps × 16 calls (an entry and a complete record
each, batches of 32 records as relays send them), then the trace of it timed in a fresh
process (CPU seconds, maximum RSS, the size line).

    PYTHONPATH=. python launch/bench/bench_trace.py [--ranks 64] [--steps 100] [--db /tmp/big.db]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

from commcheck.collector.store import Store
from commcheck.wire import PHASE_ENTRY, BatchBuilder, Record, decode, encode

T0 = 1_764_000_000.0


def write_db(path: Path, ranks: int, steps: int) -> int:
    for suffix in ("", "-wal", "-shm", ".records"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    store = Store.create(path)
    world = tuple(range(ranks))
    n = 0
    for r in world:
        b = BatchBuilder("bench", r, f"node{r // 8}", ranks)
        for step in range(steps):
            recs = []
            for k in range(16):
                seq = step * 16 + k
                base = dict(group_name="0", group_ranks=world, seq=seq,
                            op="all_reduce" if k % 4 else "all_gather_into_tensor",
                            dtype="bfloat16", callsite="train.py:10 step ← model.py:99 forward",
                            numel_in=1 << 20, numel_out=1 << 20, step=step,
                            t_enter=T0 + seq * 1e-2 + r * 1e-5)
                recs += [Record(**base, phase=PHASE_ENTRY),
                         Record(**base, t_exit=T0 + seq * 1e-2 + 5e-3)]
            store.add_batch(decode(encode(b.build(recs, seq=step))))
            n += len(recs)
    store.close()
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--db", default="/tmp/commcheck-bench-trace.db")
    a = ap.parse_args()
    n = write_db(Path(a.db), a.ranks, a.steps)
    out = f"{a.db}.trace.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "commcheck.cli", "trace", a.db, "-o", out],
                   check=True, env=os.environ)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    print(f"trace of {n} records: {cpu:.2f} s CPU, max RSS {after.ru_maxrss / 1024:.0f} MB "
          f"(start-up and imports included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
