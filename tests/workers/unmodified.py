"""A training loop that knows nothing of commcheck (no import, no call): for
``commcheck run``. ``--steps N``; ``--sleep S`` between steps (a run long enough to scrape);
faults come from COMMCHECK_INJECT. Prints "unmodified: done" on rank 0 at the end."""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    w = torch.zeros(64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(args.steps):
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
