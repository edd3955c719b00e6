"""What commcheck costs on collectives inside compiled graphs (docs/compiled.md).

    python launch/bench/bench_compiled.py [--calls 2000] [--rounds 9] [--sizes 4096,65536]
    torchrun --nproc-per-node 2 launch/bench/bench_compiled.py --tp [--steps 40] [--plain]

Per call (one process, a gloo world of one rank, as ``bench_hotpath``): the pair Inductor's
code issues for one collective, ``all_reduce_`` then ``wait_tensor`` through
``torch.ops._c10d_functional``, timed patched and with commcheck's kernels stepped over
(``BackendSelect`` excluded around the call: torch's own kernel alone), interleaved round
after round; the median per-call difference is the host time commcheck adds, as CPU time of
the calling thread and as wall time.

``--tp`` (torchrun, 2 ranks): a tensor-parallel MLP (ColwiseParallel, RowwiseParallel)
compiled with Inductor, patched unless ``--plain``; rank 0 prints one JSON line with the
first step's seconds (compilation: run with ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` and
``TORCHINDUCTOR_AUTOGRAD_CACHE=0`` for a compile from scratch) and the median step time of
the steps after it. Compare patched and ``--plain`` runs interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_tmp = tempfile.TemporaryDirectory(prefix="commcheck-compiled-")
os.environ.setdefault("COMMCHECK_DUMP_DIR", _tmp.name)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))

import commcheck  # noqa: E402

PLAIN = "--plain" in sys.argv
if not PLAIN:
    commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

OPS = torch.ops._c10d_functional


def per_call(fn, calls: int, skip: bool) -> tuple[float, float]:
    """(wall µs, thread CPU µs) per call; ``skip``: commcheck's kernels stepped over."""
    guard = torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.BackendSelect)) if skip else None
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    wall, cpu = time.perf_counter() - t, time.thread_time() - c
    del guard
    return wall / calls * 1e6, cpu / calls * 1e6


def ops(args) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    g = dist.group.WORLD.group_name
    print(f"torch {torch.__version__}; µs per all_reduce_ + wait_tensor pair, median of "
          f"{args.rounds} rounds x {args.calls} calls; added = patched - torch's kernel alone")
    print(f"{'size':>8}{'orig':>9}{'+wall':>10}{'+cpu':>9}  range")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = torch.randn(nbytes // 4)

        def pair(x=x):
            OPS.wait_tensor(OPS.all_reduce_(x, "sum", g))

        per_call(pair, 50, False)
        per_call(pair, 50, True)
        wall, cpu, base = [], [], []
        for r in range(args.rounds):
            order = (True, False) if r % 2 else (False, True)
            got = {skip: per_call(pair, args.calls, skip) for skip in order}
            wall.append(got[False][0] - got[True][0])
            cpu.append(got[False][1] - got[True][1])
            base.append(got[True][0])
        cpu.sort()
        print(f"{nbytes >> 10:>6}Ki{statistics.median(base):>9.1f}"
              f"{statistics.median(wall):>10.1f}{statistics.median(cpu):>9.1f}"
              f"  [{cpu[0]:.1f}..{cpu[-1]:.1f}]", flush=True)
    dist.destroy_process_group()


def tp(args) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.compile(parallelize_module(model, mesh, {"0": ColwiseParallel(),
                                                           "2": RowwiseParallel()}))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for step in range(args.steps + 1):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step))
        t = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        print(json.dumps({"patched": not PLAIN, "first_step_s": round(times[0], 3),
                          "step_ms": round(statistics.median(times[1:]) * 1e3, 3)}),
              flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sizes", default="4096,65536", help="bytes, comma separated")
    ap.add_argument("--tp", action="store_true", help="compiled TP step (torchrun, 2 ranks)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--plain", action="store_true", help="--tp without commcheck")
    args = ap.parse_args()
    if args.tp:
        tp(args)
    else:
        ops(args)


if __name__ == "__main__":
    main()
