"""Overhead of commcheck on collectives: patched vs unpatched, interleaved in the same job.

    torchrun --nproc-per-node 4 launch/bench_overhead.py [--max-mib 64] [--seconds 2]
    torchrun --nproc-per-node 4 launch/bench_overhead.py --ddp [--steps 60]

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
import sys
import tempfile
import time

import commcheck

_tmp = None
if "--ddp" in sys.argv:
    os.environ.setdefault("COMMCHECK_DDP", "0")  # only the models the bench watches
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


def _send_recv(t: torch.Tensor, send=None, recv=None) -> None:
    """Ring exchange: even ranks send first, odd ranks receive first (no deadlock)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty_like(t)
    if rank % 2 == 0:
        send(t, right)
        recv(buf, left)
    else:
        recv(buf, left)
        send(t, right)


def _case(op: str, n: int, world: int):
    """(wrapped function, its arguments, tensor to restore before each call or None)."""
    x = torch.randn(n)
    per = max(n // world, 1)
    cases = {
        "all_reduce": lambda: (dist.all_reduce, (x,), x.clone()),
        "all_gather_into_tensor": lambda: (dist.all_gather_single,
                                           (torch.empty(world * n), x), None),
        "broadcast": lambda: (dist.broadcast, (x, 0), x.clone()),
        "reduce_scatter_tensor": lambda: (dist.reduce_scatter_single,
                                          (torch.empty(per), torch.randn(per * world)), None),
        "all_to_all_single": lambda: (dist.all_to_all_single,
                                      (torch.empty(per * world), torch.randn(per * world)),
                                      None),
        "reduce": lambda: (dist.reduce, (x, 0), x.clone()),
        "send_recv": lambda: (_SendRecv(), (x,), None),
    }
    return cases[op]()


class _SendRecv:
    """send + recv as one timed call; its original uses the unwrapped functions."""

    def __call__(self, t):
        _send_recv(t, dist.send, dist.recv)

    def __commcheck_original__(self, t):
        _send_recv(t, dist.send.__commcheck_original__, dist.recv.__commcheck_original__)


def bench(op: str, nbytes: int, world: int, budget_s: float) -> tuple[float, float, int]:
    patched, args, fresh = _case(op, nbytes // 4, world)
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


def ddp_steps(steps: int) -> None:
    """A nanoGPT-sized DDP step (6 x 256x256 linear layers, 4 buckets of ~100 K floats),
    the same model five ways, rotating step by step so all see the same load: plain DDP
    (its C++ reducer, no hook: the step without commcheck), torch's built-in C++ ALLREDUCE
    hook (what any comm hook costs), torch's Python ``allreduce_hook`` (what a Python hook
    costs), watched by commcheck (its C++ hook where it builds) and watched with
    ``COMMCHECK_DDP_NATIVE=0`` (its Python hook). Prints the median step of each and the
    ratios to plain DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model() -> DDP:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[m for _ in range(6) for m in
                                    (torch.nn.Linear(256, 256), torch.nn.GELU())])
        return DDP(net, bucket_cap_mb=0.4)

    plain, builtin, hooked, watched = model(), model(), model(), model()
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    DDP.register_comm_hook.__commcheck_original__(hooked, hooked.process_group,
                                                  default_hooks.allreduce_hook)
    assert commcheck.watch(watched)
    os.environ["COMMCHECK_DDP_NATIVE"] = "0"
    python = model()
    assert commcheck.watch(python)
    del os.environ["COMMCHECK_DDP_NATIVE"]
    native = watched._commcheck_slot.native is not None
    names = ("plain", "builtin", "python-hook", "commcheck" if native else "commcheck(no C++)",
             "commcheck-python")
    runs = [(m, torch.optim.SGD(m.parameters(), lr=1e-3), [])
            for m in (plain, builtin, hooked, watched, python)]
    x = torch.randn(64, 256)
    for i in range(steps + 5):
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        for m, opt, acc in order:
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
            if i >= 5:
                acc.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        med = [statistics.median(r[2]) for r in runs]
        print(f"DDP step, {dist.get_world_size()} ranks, {steps} steps each, median ms "
              f"(ratio to plain): " + ", ".join(f"{n} {t * 1e3:.2f} ({t / med[0]:.3f})"
                                                for n, t in zip(names, med, strict=True)),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=2.0, help="time budget per size and op")
    ap.add_argument("--ops", default="all_reduce,all_gather_into_tensor",
                    help="comma list of: all_reduce, all_gather_into_tensor, broadcast, "
                         "reduce_scatter_tensor, all_to_all_single, reduce, send_recv")
    ap.add_argument("--ddp", action="store_true", help="time a DDP training step instead")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if args.ddp:
        ddp_steps(args.steps)
        dist.destroy_process_group()
        return
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
