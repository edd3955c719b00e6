"""Writes the databases under this folder through the real collector path, and the report
each one must keep producing. ``tests/unit/test_report_output.py`` reads them.

    PYTHONPATH=. python tests/unit/data/report/make.py        # from the repository root

Run it only to add a case: the committed ``*.db`` files are what an older collector wrote,
and the ``*.json`` / ``*.txt`` files pin what ``commcheck report`` made of them. Each
database is fed message by message through :class:`commcheck.collector.pipeline.Pipeline`
(records, hangs, close, persist, as ``commcheck collect`` does); then its engine snapshot is
dropped (``report`` never reads it; a pickled engine is tied to one commcheck version) and
the file is vacuumed into 4 KiB pages and rollback-journal mode to stay small and
read-only-safe.

* ``every_kind``: every finding kind — value_mismatch (summarized, hash-only, injected,
  a tie), link_corruption (one link, two links in one finding), reduction_error (one rank
  with an infinite output, an ambiguous consistent-but-wrong sum), desync (numel, splits,
  an ambiguous op split), missing_rank (during the run; at its end, with a rank that never
  reported), nan_inf (injected, with later collectives folded; a probe's), grad_divergence
  (injected, with later steps folded) and param_divergence (a tie); rank counters (dropped,
  spilled, not checked, bypassed), a rejected message; suspect link, sender and receiver.
* ``suspects``: one rank on one host is the culprit of every finding: suspect host, rank,
  link and receiver.
* ``clean``: records and no finding.
* ``ties``: two ranks (issue 18): ties settled by the records, or not and why; a link
  corruption alone; a corrupted receive named as the recv; the per-op table.
* ``words``: two culprits named alike (rank and host suspects), a missing_rank whose
  entered ranks are one waiting, one dead after entering.
* ``liveness``: what the relays see of each rank, given to the engine as the collector
  will (``Engine.observe``): rank 2 killed by a signal after group 0's seq 2 while the
  others wait in seqs 3 and 4 (one rank_died, no missing_rank), a hang in ``tp[0,1]``
  with rank 1 stopped (seq 1 folded), an ambiguous hang in ``pp[0,3]``, rank 4 alive and
  missing from ``dp[3,4]`` (seq 1 folded). Nobody says goodbye: the job was killed hung.
"""

from __future__ import annotations

import io
import json
import math
import sqlite3
import sys
from pathlib import Path

from commcheck.collector.pipeline import Pipeline
from commcheck.collector.report import load, render, to_json
from commcheck.collector.store import Store
from commcheck.engine import Engine
from commcheck.engine.state import Liveness
from commcheck.wire import (
    F_IN_HASH,
    F_IN_SUMMARY,
    F_INJECTED,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    GOODBYE,
    HELLO,
    PHASE_ENTRY,
    SIDE_IN,
    SIDE_OUT,
    BatchBuilder,
    Chunk,
    Record,
    encode,
)
from tests.unit.test_report_output import text_console

HERE = Path(__file__).parent
FULL = F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY
HASHES = F_IN_HASH | F_OUT_HASH
PROBE = F_OUT_HASH | F_OUT_SUMMARY
W4 = (0, 1, 2, 3)
HOST = {0: "node0", 1: "node0", 2: "node1", 3: "node1", 4: "node2"}


def rec(seq: int, t: float, *, op: str = "all_reduce", group: tuple = ("0", W4),
        out=(1, 1), out_sum: float = 10.0, out_nan: int = 0, in_sum: float = 2.5,
        in_nan: int = 0, flags: int = FULL, step: int | None = None, **kw) -> Record:
    base = dict(group_name=group[0], group_ranks=group[1], seq=seq, op=op, dtype="float32",
                algo="xxh3-128", callsite=f"train.py:{40 + seq} step", numel_in=100,
                numel_out=100, in_hash=(5, 5), out_hash=out, flags=flags,
                in_summary=(in_sum, 1.0, in_nan, 0), out_summary=(out_sum, 1.0, out_nan, 0),
                step=seq if step is None else step, t_enter=t - 0.5, t_done=t)
    base.update(kw)
    return Record(**base)


def gathered(rank: int, seq: int, t: float, bad_from: tuple[int, ...]) -> Record:
    """An all_gather where what ``rank`` got from each of ``bad_from`` was corrupted."""
    recv = [Chunk(SIDE_OUT, src, 666 if src in bad_from else 100 + src, 0) for src in W4]
    return rec(seq, t, op="all_gather", out=(1000 + sum(bad_from) if bad_from else 1, 0),
               in_hash=(100 + rank, 0), chunks=recv, flags=HASHES)


def every_kind() -> tuple[int, dict[int, list[Record]], dict[int, dict[str, int]]]:
    recs: dict[int, list[Record]] = {r: [] for r in HOST}
    for r in W4:
        add = recs[r].append
        # seq 0: rank 2's all_reduce output differs; sums say by how much
        add(rec(0, 100.0, out=(9, 9) if r == 2 else (1, 1),
                out_sum=12.5 if r == 2 else 10.0))
        # seq 1: two against two, hashes only: a tie
        add(rec(1, 101.0, out=(2, 2) if r >= 2 else (1, 1), flags=HASHES))
        # seq 2: hashes only, injected on rank 3
        add(rec(2, 102.0, out=(3, 3) if r == 3 else (1, 1),
                flags=HASHES | (F_INJECTED if r == 3 else 0)))
        # seq 3, 4: corrupted all_gather chunks 1→3; then 0→3 and 1→3, and 1→2 (injected)
        add(gathered(r, 3, 103.0, (1,) if r == 3 else ()))
        g = gathered(r, 4, 104.0, {3: (0, 1), 2: (1,)}.get(r, ()))
        if r == 2:
            g.flags |= F_INJECTED
        add(g)
        # seq 5: reduce_scatter whose output on rank 1 is infinite
        in_sums = [1.0, 2.0, 3.0, 4.0]
        add(rec(5, 105.0, op="reduce_scatter_single", redop="SUM", out=(r, 0),
                in_sum=sum(in_sums), out_sum=math.inf if r == 1 else 4 * in_sums[r],
                chunks=[Chunk(SIDE_IN, dst, dst, r, s) for dst, s in enumerate(in_sums)]))
        # seq 6: every output agrees, and every one is wrong
        add(rec(6, 106.0, redop="SUM", in_sum=1.0, out_sum=100.0))
        # seq 7: rank 1 reduces 50 elements, the others 100
        add(rec(7, 107.0, numel_in=50 if r == 1 else 100))
        # seq 8: rank 0 splits its input, nobody else does
        add(rec(8, 108.0, in_splits=(40, 60) if r == 0 else ()))
        # seq 9: two ranks broadcast while two all_reduce
        add(rec(9, 109.0, op="broadcast", root=0) if r >= 2 else rec(9, 109.0))
        # seq 10-12: NaN in rank 3's inputs (injected at first); 11, 12 fold into 10
        for seq in (10, 11, 12):
            add(rec(seq, 100.0 + seq, in_nan=2 if r == 3 else 0,
                    flags=FULL | (F_INJECTED if r == 3 and seq == 10 else 0)))
        # the gradient probe: rank 1's gradient diverges at steps 5-7 (injected at 5) ...
        for seq in (0, 1, 2):
            add(rec(seq, 90.0 + seq, op="grad", group=("grad:layer.weight", W4), step=5 + seq,
                    out=(9, 9) if r == 1 else (1, 1), out_sum=7.0 if r == 1 else 5.0,
                    flags=PROBE | (F_INJECTED if r == 1 and seq == 0 else 0)))
        # ... parameters split two against two, a bias gradient carries a NaN on rank 0
        add(rec(0, 95.0, op="param", group=("param:layer.weight", W4), step=5,
                out=(2, 2) if r >= 2 else (1, 1), out_sum=6.0 if r >= 2 else 5.0, flags=PROBE))
        add(rec(0, 96.0, op="grad", group=("grad:layer.bias", W4), step=5,
                out_nan=1 if r == 0 else 0, flags=PROBE))
        # seq 13: rank 3 never enters (a hang seen during the run)
        if r != 3:
            add(rec(13, 200.5, phase=PHASE_ENTRY))
    # at the run's end, rank 1 never joined rank 0 in group 1, rank 4 never reported
    recs[0].append(rec(0, 235.5, group=("1", (0, 1)), phase=PHASE_ENTRY))
    recs[2].append(rec(0, 236.5, group=("2", (2, 4)), phase=PHASE_ENTRY))
    counters = {0: {"dropped": 3, "spilled": 5, "not_checked": 2, "bypassed:0": 4},
                1: {"bypassed:0": 6, "bypassed:1": 1}}
    return 5, recs, counters


def suspects() -> tuple[int, dict[int, list[Record]], dict[int, dict[str, int]]]:
    recs: dict[int, list[Record]] = {r: [] for r in W4}
    for seq, bad in enumerate(((1,), (1,), (1,), (0,))):
        for r in W4:
            recs[r].append(gathered(r, seq, 100.0 + seq, bad if r == 3 else ()))
    return 4, recs, {}


W2 = (0, 1)


def ties() -> tuple[int, dict[int, list[Record]], dict[int, dict[str, int]]]:
    """Two ranks (issue 18): a high-bit flip in rank 1's all_reduce (one
    culprit, with the sums that say so); a low-bit flip in a ddp_allreduce (ambiguous, and
    why); rank 1's corrupted all_gather chunk from 0 (one link_corruption, nothing else);
    rank 1's corrupted receive of 0's isend (reported as the recv)."""
    recs: dict[int, list[Record]] = {r: [] for r in W2}
    in_sums = {0: -1.8187, 1: 0.2984}
    for r in W2:
        add = recs[r].append
        add(rec(0, 100.0, group=("0", W2), redop="SUM", out=(7, 7) if r else (1, 1),
                in_sum=in_sums[r], out_sum=-1.43e37 if r else -1.5203))
        add(rec(1, 101.0, op="ddp_allreduce", group=("0", W2), redop="SUM",
                out=(7, 7) if r else (1, 1), in_sum=in_sums[r],
                out_sum=-1.5203 + (2e-7 if r else 0.0)))
        recv = [Chunk(SIDE_OUT, src, 666 if (r, src) == (1, 0) else 100 + src, 0) for src in W2]
        add(rec(2, 102.0, op="all_gather", group=("0", W2), out=(1000 + r, 0),
                in_hash=(100 + r, 0), chunks=recv, flags=HASHES))
    recs[0].append(rec(0, 103.0, op="send", group=("p2p:0->1", W2), peer=1, numel_out=0,
                       in_hash=(55, 5), out=(0, 0), flags=F_IN_HASH,
                       chunks=[Chunk(SIDE_IN, 1, 55, 5)]))
    recs[1].append(rec(0, 103.0, op="recv", group=("p2p:0->1", W2), peer=0, numel_in=0,
                       in_hash=(0, 0), out=(56, 5), flags=F_OUT_HASH,
                       chunks=[Chunk(SIDE_OUT, 0, 56, 5)]))
    return 2, recs, {}


def words() -> tuple[int, dict[int, list[Record]], dict[int, dict[str, int]]]:
    """Four ranks on two hosts (issue 18's words): ranks 2 and 3 both wrong in two
    all_reduces (ties settled by the sums: both named, one suspect line for both; the host
    counts 2 findings, not 4 culprits); then ranks 0 and 1 enter group 1's seq 0 and 2, 3
    never do: rank 0 alive and waiting, rank 1 dead after entering (seen by its relay)."""
    recs: dict[int, list[Record]] = {r: [] for r in W4}
    for r in W4:
        for seq in (0, 1):
            recs[r].append(rec(seq, 100.0 + seq, redop="SUM", out=(9, 9) if r >= 2 else (1, 1),
                               out_sum=7.5e30 if r >= 2 else 10.0))
    for r in (0, 1):
        recs[r].append(rec(0, 200.5, group=("1", W4), phase=PHASE_ENTRY))
    return 4, recs, {}


WORDS_SEEN = {0: Liveness(state="alive", idle_s=1.0, pid=4200, seen_t=239.0),
              1: Liveness(state="gone", exit_code=1, idle_s=38.0, pid=4201, seen_t=239.0)}


def clean() -> tuple[int, dict[int, list[Record]], dict[int, dict[str, int]]]:
    return 4, {r: [rec(seq, 100.0 + seq) for seq in range(3)] for r in W4}, {}


def liveness() -> tuple[int, dict[int, list[Record]], dict[int, dict[str, int]]]:
    recs: dict[int, list[Record]] = {r: [] for r in HOST}
    for r in W4:
        for seq in range(3):  # clean; rank 2 is killed after seq 2
            recs[r] += [rec(seq, 200.0 + seq, phase=PHASE_ENTRY), rec(seq, 200.0 + seq)]
        if r != 2:  # the others go on into seqs 3 and 4 and wait there
            recs[r] += [rec(seq, 200.0 + seq, phase=PHASE_ENTRY) for seq in (3, 4)]
    for r in (0, 1):  # both enter tp seqs 0 and 1; rank 1 is then stopped (a debugger)
        recs[r] += [rec(seq, 205.0 + seq, group=("tp", (0, 1)), phase=PHASE_ENTRY)
                    for seq in (0, 1)]
    for r in (0, 3):  # both enter pp seq 0, neither completes, both alive: ambiguous
        recs[r].append(rec(0, 207.0, group=("pp", (0, 3)), phase=PHASE_ENTRY))
    # rank 4, alive (its records lost), never enters dp seqs 0 and 1
    recs[3] += [rec(seq, 208.0 + seq, group=("dp", (3, 4)), phase=PHASE_ENTRY) for seq in (0, 1)]
    return 5, recs, {}


SEEN = {  # what the relays see of each rank at t=239 (liveness case)
    0: Liveness(state="alive", idle_s=32.5, pid=4100, seen_t=239.0),
    1: Liveness(state="stopped", idle_s=33.5, pid=4101, seen_t=239.0),
    2: Liveness(state="gone", signal=9, idle_s=36.0, pid=4102, seen_t=239.0),
    3: Liveness(state="alive", idle_s=30.5, pid=4103, seen_t=239.0),
    4: Liveness(state="alive", idle_s=0.5, pid=4104, seen_t=239.0),
}


def write(name: str, world: int, recs: dict[int, list[Record]],
          counters: dict[int, dict[str, int]], garbage: bool,
          seen: dict[int, Liveness] | None = None) -> None:
    path = HERE / f"{name}.db"
    path.unlink(missing_ok=True)
    store = Store.create(path, "rows")  # one self-contained file
    pipe = Pipeline(Engine(world), store)
    builders = {r: BatchBuilder("job", r, HOST[r], world, node=int(HOST[r][-1]))
                for r in recs}
    for b in builders.values():
        pipe.feed(encode(b.control(HELLO, 0, t=1.0)))
    for r, b in builders.items():
        if recs[r]:
            pipe.feed(encode(b.build(recs[r], seq=1, t=150.0)))
    if garbage:
        pipe.feed(b"\x93not a commcheck message")
    if seen:  # the collector's relay plumbing is not there yet: straight to the engine
        pipe.engine.observe_many(seen, 239.0)
    pipe.check_hangs(240.0)
    pipe.persist()
    for r, b in builders.items():
        if not seen:  # a liveness case's job was killed: nobody says goodbye
            pipe.feed(encode(b.control(GOODBYE, 2, t=250.0, counters=counters.get(r))))
    pipe.close_run(260.0)
    pipe.persist()
    store.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DELETE FROM snapshot")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("PRAGMA page_size=4096")
    conn.execute("VACUUM")
    conn.close()


def expected(name: str) -> None:
    """What ``commcheck report --json`` prints, and the rich report at 160 columns."""
    findings, summary = load(Store.open(HERE / f"{name}.db"))
    (HERE / f"{name}.json").write_text(json.dumps(to_json(findings, summary), indent=2) + "\n")
    buf = io.StringIO()
    render(findings, summary, text_console(buf))
    (HERE / f"{name}.txt").write_text(buf.getvalue())


CASES = {"every_kind": (every_kind, True, None), "suspects": (suspects, False, None),
         "clean": (clean, False, None), "liveness": (liveness, False, SEEN),
         "ties": (ties, False, None), "words": (words, False, WORDS_SEEN)}

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        make, garbage, seen = CASES[name]
        write(name, *make(), garbage=garbage, seen=seen)
        expected(name)
        print(name, (HERE / f"{name}.db").stat().st_size, "bytes")
