"""Overhead of commcheck on collectives: patched vs unpatched, interleaved in the same job.

    torchrun --nproc-per-node 4 launch/bench_overhead.py [--max-mib 64] [--seconds 2]

Every rank patches (records go to a temporary dump directory unless COMMCHECK_COLLECTOR is
set) and then alternates, per size and repetition, between the wrapped function and the
original it wraps (``__commcheck_original__``), with a barrier before each timed call so
the ranks stay in step. Rank 0 prints the median time of each and their ratio. Absolute
times on a shared box are noise; the ratio measured in one run is the figure to quote.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import commcheck

_tmp = None
if not os.environ.get("COMMCHECK_COLLECTOR"):
    _tmp = tempfile.TemporaryDirectory(prefix="commcheck-bench-")
    os.environ.setdefault("COMMCHECK_DUMP_DIR", _tmp.name)
commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def sizes(max_mib: int) -> list[int]:
    out, s = [], 4 << 10
    while s <= max_mib << 20:
        out.append(s)
        s *= 4
    return out


def timed(fn, *args, fresh: torch.Tensor | None = None) -> float:
    if fresh is not None:  # in-place reductions would otherwise grow the data to inf
        args[0].copy_(fresh)
    dist.barrier()
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def bench(op: str, nbytes: int, world: int, budget_s: float) -> tuple[float, float, int]:
    n = nbytes // 4
    x = torch.randn(n)
    fresh = None
    if op == "all_reduce":
        patched, args, fresh = dist.all_reduce, (x,), x.clone()
    else:
        patched, args = dist.all_gather_single, (torch.empty(world * n), x)
    original = patched.__commcheck_original__
    for fn in (patched, original):
        fn(*args)
    probe = timed(original, *args, fresh=fresh)
    reps = torch.tensor([max(5, min(200, int(budget_s / max(probe, 1e-6) / 2)))])
    dist.all_reduce.__commcheck_original__(reps, op=dist.ReduceOp.MIN)  # same count everywhere
    reps = int(reps)
    t_p, t_o = [], []
    for i in range(reps):
        pair = ((patched, t_p), (original, t_o)) if i % 2 else ((original, t_o), (patched, t_p))
        for fn, acc in pair:
            acc.append(timed(fn, *args, fresh=fresh))
    return statistics.median(t_p), statistics.median(t_o), reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=2.0, help="time budget per size and op")
    ap.add_argument("--ops", default="all_reduce,all_gather_into_tensor")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"world {world}, gloo, CPU; median seconds per call; ratio = patched/unpatched")
        print(f"{'op':<24}{'size':>10}{'unpatched':>12}{'patched':>12}{'ratio':>8}{'reps':>6}")
    for op in args.ops.split(","):
        for nbytes in sizes(args.max_mib):
            p, o, reps = bench(op, nbytes, world, args.seconds)
            if rank == 0:
                size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
                print(f"{op:<24}{size:>10}{o:>12.5f}{p:>12.5f}{p / o:>8.3f}{reps:>6}",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
