"""Per-record cost of getting a record out of the training thread, old and new way.

    PYTHONPATH=. python launch/bench/bench_record_write.py              # this checkout
    PYTHONPATH=/path/to/main python launch/bench/bench_record_write.py  # one with rank/sender.py

With the ring (``commcheck.rank.ring``): the training thread's ``submit`` encodes the record
and copies it into the memory-mapped ring (what it pays per record), and, for comparison,
what the relay then spends per record in its own process (decode the entry, columnar
batch, encode). With the sender thread (``commcheck.rank.sender``, before the relay): the
training thread's ``submit`` (a deque append) plus what the sender thread spent per record
in the same process (columnar batch + encode), which competed with training for the GIL.
Two records: an all_reduce completion (no chunks) and an all_gather completion over 8
ranks (8 chunk hashes). Best of ``--reps`` runs of ``--n`` records.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from commcheck.rank.session import _Ready
from commcheck.wire import (
    F_IN_HASH,
    F_IN_SUMMARY,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    SIDE_OUT,
    BatchBuilder,
    Chunk,
    Record,
    encode,
)


def records() -> dict[str, Record]:
    now = time.time()
    base = dict(group_name="0", group_ranks=tuple(range(8)), seq=12345, dtype="float32",
                algo="xxh3-128", callsite="train.py:42 main", numel_in=1 << 20,
                numel_out=1 << 20, in_shape=(1024, 1024), out_shape=(1024, 1024), step=77,
                t_enter=now, t_exit=now, t_done=now, in_hash=(1 << 63, 12345),
                out_hash=(99, 1 << 62), in_summary=(1.5, 2.0, 0, 0),
                out_summary=(12.0, 2.0, 0, 0),
                flags=F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY)
    return {
        "all_reduce": Record(op="all_reduce", redop="SUM", **base),
        "all_gather x8": Record(op="all_gather", chunks=[
            Chunk(SIDE_OUT, r, r * 7 + 1, r * 13 + 5) for r in range(8)], **base),
    }


def best(fn, reps: int) -> float:
    return min(fn() for _ in range(reps))


def bench_ring(rec: Record, n: int, reps: int) -> tuple[float, float]:
    from commcheck.rank.ring import RingWriter
    from commcheck.relay.channel import Channel
    from commcheck.wire.relay_settings import RelaySettings
    from commcheck.wire.ring import Identity, Ring

    tmp = tempfile.mkdtemp(prefix="commcheck-bench-")

    def writes() -> float:
        ident = Identity(run="bench", rank=0, host="h", world=8, node=0, pid=os.getpid(),
                         dest=f"dump:{tmp}")
        w = RingWriter.create(os.path.join(tmp, "rings"), ident, 64 << 20)  # no relay
        item = _Ready(rec)
        t0 = time.perf_counter()
        for _ in range(n):
            w.submit(item)
        dt = (time.perf_counter() - t0) / n
        w.ring.close = lambda: None  # keep it for the relay's half
        bench_ring.last = w  # type: ignore[attr-defined]
        return dt

    train = best(writes, reps)
    w = bench_ring.last  # type: ignore[attr-defined]
    ch = Channel(Ring.open(w.path), RelaySettings(batch_records=512, flush_interval=0.0,
                                             dump_dir=os.path.join(tmp, "dump")), None)
    t0 = time.process_time()
    while ch.poll(time.monotonic()):
        pass
    relay = (time.process_time() - t0) / n
    ch.close(remove=True)
    return train, relay


def bench_sender(rec: Record, n: int, reps: int) -> tuple[float, float]:
    from commcheck.rank.sender import Sender

    class Null:
        acked = False

        def send(self, payload: bytes) -> bool:
            return True

        def close(self, linger: float) -> None:
            pass

    builder = BatchBuilder("bench", 0, "h", 8, 0)

    def submits() -> float:
        s = Sender(builder, Null(), 512, 0.05, n + 1)  # thread not started: submit alone
        item = _Ready(rec)
        t0 = time.perf_counter()
        for _ in range(n):
            s.submit(item)
        return (time.perf_counter() - t0) / n

    train = best(submits, reps)

    def thread_work() -> float:  # what the sender thread did per record: batch + encode
        batch = [rec] * 512
        t0 = time.process_time()
        for i in range(n // 512):
            encode(builder.build(batch, i, time.time(), counters={"records": i}))
        return (time.process_time() - t0) / (n // 512 * 512)

    return train, best(thread_work, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    try:
        import commcheck.rank.ring  # noqa: F401

        mode, fn = "ring (training thread writes; relay process ships)", bench_ring
    except ImportError:
        mode, fn = "sender thread (deque on the training thread; thread batches)", bench_sender
    print(f"{mode}: {args.n} records, best of {args.reps}")
    for name, rec in records().items():
        train, other = fn(rec, args.n, args.reps)
        where = "relay process" if fn is bench_ring else "sender thread, same process"
        print(f"  {name:14s} training thread {train * 1e6:6.2f} us/record   "
              f"{where} {other * 1e6:6.2f} us/record")


if __name__ == "__main__":
    main()
