"""The relay's CPU per record, alone: how much of a core a rank's stream of records costs
the node's relay (docs/startup.md, "What the relay costs a training step").

    PYTHONPATH=. python launch/bench/bench_relay.py [--records 20000] [--repeat 3] [--profile]

A child process (the rank side imported, as a rank has it) writes ``--records`` records
like the per-call path's (entry and complete, alternating) into a ring and leaves; this
process, with only the relay's imports and its GC settings, reads them into messages
through the relay's own ``Channel`` (batches of 512, the collector's acks given at once,
the messages kept, not sent) and prints the CPU seconds it took per record (process time:
the figure holds on a loaded box, where wall time does not). ``--profile`` adds cProfile's
top entries. ``PYTHONPATH`` decides whose commcheck runs (an older tree: the same figure
without this relay's GC settings, which it does not have).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time


def record(i: int):
    from commcheck.wire import F_IN_HASH, F_IN_SUMMARY, F_OUT_HASH, F_OUT_SUMMARY, Record

    now = time.time()
    return Record(group_name="0", group_ranks=(0, 1, 2, 3), seq=i // 2, op="all_reduce",
                  dtype="float32", redop="SUM", algo="xxh3-128",
                  callsite="/home/user/train.py:120 step",
                  flags=F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY,
                  numel_in=1024, numel_out=1024, in_shape=(1024,), out_shape=(1024,),
                  step=i // 20, t_enter=now, t_exit=now, t_done=now,
                  in_hash=(0x1234_5678_9ABC_DEF0, i), out_hash=(0x0FED_CBA9_8765_4321, i),
                  in_summary=(1.5, 3.25, 0, 0), out_summary=(6.0, 13.0, 0, 0), phase=i % 2)


def write(folder: str, n: int) -> None:
    """The child: a ring of ``n`` records; prints its path and leaves it behind."""
    from commcheck.rank.ring import RingWriter
    from commcheck.rank.session import _Ready
    from commcheck.wire.ring import Identity, destination

    ident = Identity(run="bench-relay", rank=0, host="h", world=4, node=-1, pid=os.getpid(),
                     dest=destination("tcp://127.0.0.1:1", ""))
    w = RingWriter.create(folder, ident, max(64 << 20, n * 512))  # no relay launch
    w.start()
    for i in range(n):
        w.submit(_Ready(record(i)))
    print(w.path, flush=True)
    os._exit(0)  # the ring stays, as a killed rank's does


class Kept:
    """The link: keeps what the relay sends."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, payload: bytes) -> bool:
        self.sent.append(payload)
        return True


def serve(path: str, n: int, profile: cProfile.Profile | None) -> tuple[float, int, int]:
    """(CPU seconds, messages, bytes) the relay's channel takes to ship ``path``."""
    from commcheck.relay import relay
    from commcheck.relay.channel import Channel
    from commcheck.wire.relay_settings import RelaySettings
    from commcheck.wire.ring import Ring

    link = Kept()
    ch = Channel(Ring.open(path), RelaySettings(batch_records=512, flush_interval=0.0), link)
    quiet_gc = getattr(relay, "quiet_gc", contextlib.nullcontext)  # an older relay: none
    with quiet_gc():
        if profile is not None:
            profile.enable()
        cpu, read = time.process_time(), 0
        while read < n:
            read += ch.poll(1e9, owner_gone=True)
            ch.pump(1e9)
            ch.acked([(ch.pid, s) for s in range(ch.acked_seq, ch.next_seq)])
        cpu = time.process_time() - cpu
        if profile is not None:
            profile.disable()
    ch.close(remove=True)
    return cpu, len(link.sent), sum(map(len, link.sent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        write(args.child, args.records)
    import commcheck.relay.relay  # noqa: F401  the relay's imports, before its GC settings

    per_record = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="commcheck-bench-relay-") as folder:
            path = subprocess.run(
                [sys.executable, __file__, "--records", str(args.records), "--child", folder],
                check=True, capture_output=True, text=True).stdout.strip()
            profile = cProfile.Profile() if args.profile else None
            cpu, messages, size = serve(path, args.records + 1, profile)  # and the hello
            per_record.append(cpu / args.records * 1e6)
            print(f"{args.records} records, {messages} messages, {size / args.records:.0f} "
                  f"bytes a record: {per_record[-1]:.2f} µs relay CPU per record", flush=True)
            if profile is not None:
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    print(f"median {statistics.median(per_record):.2f} µs relay CPU per record "
          f"(load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
