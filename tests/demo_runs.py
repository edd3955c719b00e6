"""Databases shaped like `make demo`'s run, written through the real collector path
(Pipeline → engine → Store), for the views' tests (trace, HTML report).

* :func:`demo`: 4 ranks on 2 hosts (node0: 0, 1; node1: 2, 3), 30 training steps, each an
  all_reduce of the gradients, every 5th a broadcast from rank 0, every 10th an all_gather
  whose chunk from rank 1 arrives corrupted on rank 3 at step 10; rank 2's all_reduce output
  at step 20 flipped by fault injection (the demo's bit flip). Each call an entry record then
  its complete record, as ranks write them; every rank says goodbye.
* :func:`died`: the same ranks, 5 clean steps; then ranks 0, 1, 3 enter step 5's
  all_reduce and rank 2 is killed by signal 9 before it (its relay sees it gone).
"""

from __future__ import annotations

from pathlib import Path

from commcheck.collector.pipeline import Pipeline
from commcheck.collector.store import Store
from commcheck.engine import Engine
from commcheck.engine.state import Liveness
from commcheck.wire import (
    DUMP_MAGIC,
    F_IN_HASH,
    F_IN_SUMMARY,
    F_INJECTED,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    GOODBYE,
    HELLO,
    PHASE_ENTRY,
    SIDE_OUT,
    BatchBuilder,
    Chunk,
    Record,
    encode,
    write_frame,
)

T0 = 1_764_000_000.0
W4 = (0, 1, 2, 3)
HOST = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
FULL = F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY
CULPRIT, BAD_STEP = 2, 20


def _pair(rank: int, op: str, seq: int, step: int, t: float, **kw) -> list[Record]:
    """The entry and complete records of one call (entry: no fingerprints, no end)."""
    base = dict(group_name="0", group_ranks=W4, seq=seq, op=op, dtype="float32",
                callsite=f"train_demo.py:{50 + len(op)} train_step", numel_in=1024,
                numel_out=1024, step=step, t_enter=t + 0.001 * rank)
    done = dict(algo="xxh3-128", flags=FULL, in_hash=(5, 5), out_hash=(1, 1),
                in_summary=(2.5, 1.0, 0, 0), out_summary=(10.0, 1.0, 0, 0),
                t_exit=t + 0.02, t_done=t + 0.02)
    for k in [k for k in kw if k in base]:
        base[k] = kw.pop(k)
    done.update(kw)
    return [Record(**base, phase=PHASE_ENTRY), Record(**base, **done)]


def demo_records() -> dict[int, list[Record]]:
    recs: dict[int, list[Record]] = {r: [] for r in W4}
    for r in W4:
        seq = 0
        for step in range(30):
            t = T0 + step * 0.1
            bad = r == CULPRIT and step == BAD_STEP
            recs[r] += _pair(r, "all_reduce", seq, step, t, redop="SUM",
                             out_hash=(9, 9) if bad else (1, 1),
                             out_summary=(12.5 if bad else 10.0, 1.0, 0, 0),
                             flags=FULL | (F_INJECTED if bad else 0))
            seq += 1
            if step % 5 == 0:
                recs[r] += _pair(r, "broadcast", seq, step, t + 0.03, root=0)
                seq += 1
            if step % 10 == 0:
                got = [Chunk(SIDE_OUT, src, 666 if (r, src, step) == (3, 1, 10) else 100 + src,
                             0) for src in W4]
                recs[r] += _pair(r, "all_gather", seq, step, t + 0.06, numel_out=4096,
                                 in_hash=(100 + r, 0), chunks=got, flags=F_IN_HASH | F_OUT_HASH,
                                 out_hash=(1000 + (r == 3 and step == 10), 0))
                seq += 1
    return recs


def _messages(recs: dict[int, list[Record]], goodbye: bool, now: float) -> list[bytes]:
    """Each rank's hello, two batches of records and (``goodbye``) its goodbye."""
    builders = {r: BatchBuilder("demo", r, HOST[r], 4, node=r // 2) for r in W4}
    out = [encode(b.control(HELLO, 0, t=T0 - 1)) for b in builders.values()]
    for r, b in builders.items():
        half = len(recs[r]) // 2
        out += [encode(b.build(recs[r][:half], seq=1, t=T0)),
                encode(b.build(recs[r][half:], seq=2, t=T0 + 1))]
    if goodbye:
        out += [encode(b.control(GOODBYE, 3, t=now)) for b in builders.values()]
    return out


def _write(path: Path, records_mode: str, recs: dict[int, list[Record]], goodbye: bool,
           seen: dict[int, Liveness] | None = None, now: float = T0 + 10) -> Path:
    store = Store.create(path, records_mode)
    pipe = Pipeline(Engine(4), store)
    messages = _messages(recs, goodbye, now)
    for m in messages[:-4] if goodbye else messages:
        pipe.feed(m)
    if seen:
        pipe.engine.observe_many(seen, now - 1)
    pipe.check_hangs(now)
    pipe.persist()
    for m in messages[-4:] if goodbye else ():
        pipe.feed(m)
    pipe.close_run(now + 1)
    pipe.persist()
    store.close()
    return path


def demo_dump(path: Path) -> Path:
    """The demo run's messages as a dump file (``COMMCHECK_DUMP_DIR``'s format), for
    ``commcheck analyze``."""
    with open(path, "wb") as f:
        f.write(DUMP_MAGIC)
        for m in _messages(demo_records(), True, T0 + 10):
            write_frame(f, m)
    return path


def demo(path: Path, records_mode: str = "file") -> Path:
    return _write(path, records_mode, demo_records(), goodbye=True)


def died(path: Path, records_mode: str = "file") -> Path:
    recs: dict[int, list[Record]] = {r: [] for r in W4}
    for r in W4:
        for step in range(5):
            recs[r] += _pair(r, "all_reduce", step, step, T0 + step * 0.1)
        if r != CULPRIT:
            recs[r].append(_pair(r, "all_reduce", 5, 5, T0 + 0.5)[0])
    seen = {r: Liveness(state="alive", idle_s=5.0, pid=100 + r, seen_t=T0 + 6)
            for r in W4 if r != CULPRIT}
    seen[CULPRIT] = Liveness(state="gone", signal=9, idle_s=5.5, pid=102, seen_t=T0 + 6)
    return _write(path, records_mode, recs, goodbye=False, seen=seen, now=T0 + 7)
