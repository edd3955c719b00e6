"""The job user's side of the shared-node file attacks (tests/integration/test_security_files.py):
rank-side ring writers, their relays and the relay's own files, run as the job's user after
the intruder planted its files.

Prints its pid, then waits for the plan, one JSON line on stdin (sent once the intruder
planted its files, some named after that pid), runs each case of the plan and prints one
JSON line of results. Log lines (the ranks' and relays' one-line refusals) go to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from commcheck.rank.ring import RingWriter
from commcheck.relay.folders import run_folder
from commcheck.relay.spill import Spill
from commcheck.wire import Record
from commcheck.wire.relay_settings import RelaySettings
from commcheck.wire.ring import Identity, destination

CAPACITY = 1 << 20


def record(seq: int) -> Record:
    return Record(group_name="0", group_ranks=(0,), seq=seq, op="all_reduce", dtype="float32",
                  algo="xxh3-128", callsite="train.py:1 main", numel_in=4, numel_out=4,
                  in_hash=(1, 2), out_hash=(3, 4))


def ring_case(run: str, ring_dir: str, dump_dir: str, records: int = 5) -> dict:
    """A rank's ring with a relay (dump files): what it recorded and where."""
    dest = destination("", dump_dir)
    ident = Identity(run=run, rank=0, host="node", world=1, node=0, pid=os.getpid(),
                     dest=dest, local_rank=0, local_world=1)
    relay = RelaySettings(run=run, node=0, dump_dir=dump_dir, spill_bytes=1 << 20,
                          buffer_bytes=1 << 20, ack_timeout=1.0, batch_records=64,
                          flush_interval=0.01, linger=2.0)
    try:
        w = RingWriter.create(ring_dir, ident, CAPACITY, relay)
    except Exception as e:  # what happened before: nothing recorded
        return {"error": f"{type(e).__name__}: {e}"}
    w.start()
    for seq in range(records):
        w.write_record(record(seq))
    placed = os.path.dirname(w.path)
    acked = w.close(linger=20.0)
    return {"acked": acked, "ring_dir": placed, "ring_name": os.path.basename(w.path),
            "refused": sorted(k for k in w.counters if k.startswith("refused_file:")),
            "mode": stat.S_IMODE(os.stat(placed).st_mode)}


def relay_case(run: str, ring_dir: str, dump_dir: str, ready: str) -> dict:
    """The relay as ``commcheck run`` starts it, pointed at a folder that is not safe."""
    r = subprocess.run([sys.executable, "-m", "commcheck.relay", "--run", run, "--node", "0",
                        "--dump-dir", dump_dir, "--ring-dir", ring_dir, "--log", "auto",
                        "--ready-file", ready], capture_output=True, text=True, timeout=60)
    return {"rc": r.returncode, "stderr": r.stderr}


def spill_case(spill_dir: str, run: str, planted: str) -> dict:
    """Spill files: the run folder, and a planted spill file neither read nor written."""
    folder = run_folder(spill_dir, run, "spill")
    s = Spill(Path(planted), 1 << 20)
    loaded = s.load()
    put = s.put(0, os.getpid(), b"x" * 16, 1)
    return {"folder": str(folder), "mode": stat.S_IMODE(os.stat(folder).st_mode),
            "loaded": loaded, "put": put}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    print(os.getpid(), flush=True)
    plan = json.loads(sys.stdin.readline())
    t0 = time.monotonic()
    cases = {"ring": ring_case, "relay": relay_case, "spill": spill_case}
    with ThreadPoolExecutor(len(plan)) as pool:  # independent runs: at once, like ranks
        running = {name: pool.submit(cases[case.pop("kind")], **case)
                   for name, case in plan.items()}
        out = {name: f.result() for name, f in running.items()}
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
