"""Step time and memory of a training-like loop whose collector is absent.

    torchrun --nproc-per-node 4 launch/bench/bench_no_collector.py [--steps 200] [--reps 5]

``COMMCHECK_COLLECTOR`` points at a loopback port nobody listens on (unless set), so every
batch stays unacknowledged: the relay's outbox fills to ``buffer_bytes``, then (with
``COMMCHECK_SPILL_DIR``) spills, else the rank's ring fills and drops, counted. Each rank
alternates, ``--reps`` times, ``--steps`` steps through the original collectives
(``__commcheck_original__``) and ``--steps`` through the patched ones; a step is a matmul
"forward/backward" plus the all_reduce of four gradient buckets and an all_gather. Rank 0
prints the median step time of each, their ratio, its counters and the process RSS after
each patched phase (bounded memory: it must stop growing once the ring is full).

Runs on ``main`` before the relay (a sender thread in each rank) print that sender's
counters instead. The rings go to a directory under /tmp (unless COMMCHECK_RING_DIR is
set) that rank 0 removes at exit: with the collector absent they are never acknowledged.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import socket
import statistics
import time

if not os.environ.get("COMMCHECK_RING_DIR"):
    _rings = f"/tmp/commcheck-bench-{os.getuid()}-{os.environ.get('MASTER_PORT', '0')}"
    os.environ["COMMCHECK_RING_DIR"] = _rings
    if os.environ.get("RANK", "0") == "0":  # registered first: runs after commcheck's exit
        atexit.register(lambda: (time.sleep(1.0), shutil.rmtree(_rings, ignore_errors=True)))

import commcheck  # noqa: E402

if not os.environ.get("COMMCHECK_COLLECTOR"):
    with socket.socket() as _s:  # a free port, then nobody listens on it
        _s.bind(("127.0.0.1", 0))
        os.environ["COMMCHECK_COLLECTOR"] = f"tcp://127.0.0.1:{_s.getsockname()[1]}"
os.environ.setdefault("COMMCHECK_LINGER", "0")
commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--width", type=int, default=384)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    w = torch.randn(args.width, args.width)
    x = torch.randn(64, args.width)
    grads = [torch.randn(n) for n in (65536, 32768, 16384, 4096)]
    gathered = [torch.empty(256) for _ in range(world)]
    mine = torch.randn(256)
    fns = {"unpatched": (dist.all_reduce.__commcheck_original__,
                         dist.all_gather.__commcheck_original__),
           "patched": (dist.all_reduce, dist.all_gather)}

    def step(all_reduce, all_gather) -> float:
        t = time.perf_counter()
        y = torch.tanh(x @ w) @ w.T  # "forward/backward"
        y.sum()
        for g in grads:
            all_reduce(g)
            g.mul_(1.0 / world)
        all_gather(gathered, mine)
        commcheck.step()
        return time.perf_counter() - t

    dist.all_reduce(torch.zeros(1))  # opens commcheck's channel
    times: dict[str, list[float]] = {k: [] for k in fns}
    rss = []
    for _ in range(args.reps):
        for name, (ar, ag) in fns.items():
            dist.barrier()
            times[name].extend(step(ar, ag) for _ in range(args.steps))
        rss.append(rss_mib())
    session = commcheck.active_session()
    # the ring writer (``Session.ring``; ``.sender`` on older commits, the thread before)
    sender = getattr(session, "ring", None) or getattr(session, "sender", None)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"world {world}, {args.reps} x {args.steps} steps each, collector absent "
              f"({os.environ['COMMCHECK_COLLECTOR']})")
        for k, v in med.items():
            print(f"  {k:9s} median step {v * 1e3:8.3f} ms")
        print(f"  ratio patched/unpatched {med['patched'] / med['unpatched']:.3f}")
        print(f"  RSS after each patched phase (MiB): {', '.join(f'{r:.0f}' for r in rss)}")
        if sender is not None and hasattr(sender, "stats"):  # the ring
            print(f"  rank 0's ring: {sender.stats()}")
        elif sender is not None:  # main before the relay: the sender thread
            box = sender.outbox
            print(f"  sender counters {sender.counters}; outbox {len(box) if box else 0} "
                  f"batches, {box.bytes if box else 0} bytes")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
