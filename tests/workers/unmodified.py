"""A training loop that knows nothing of commcheck (no import, no call): for
``commcheck run``. ``--steps N``; ``--sleep S`` between steps (a run long enough to scrape);
``--hold FILE``: halfway, every rank waits until FILE exists (a run a test acts on while it
trains); faults come from COMMCHECK_INJECT. Prints "unmodified: done" on rank 0 at the end."""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _hold(path: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--hold", default="")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    w = torch.zeros(64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(args.steps):
        if args.hold and step == args.steps // 2:
            _hold(args.hold)
        x = torch.full((64,), float(rank + step))
        dist.all_reduce(x)
        w.grad = x / dist.get_world_size()
        opt.step()
        if args.sleep:
            time.sleep(args.sleep)
    dist.destroy_process_group()
    if rank == 0:
        print("unmodified: done", flush=True)


if __name__ == "__main__":
    main()
