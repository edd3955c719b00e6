"""A steady stream of collectives for the delivery tests: ``WORKER_STEPS`` steps (default
100), each an all_reduce, an all_gather and a broadcast, ``WORKER_SLEEP`` seconds apart
(default 0.03), so a collector can be killed, or the link cut, while it runs. Writes each
rank's step times to ``WORKER_TIMES`` (a directory) when set.
"""

import os
import time
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = int(os.environ.get("WORKER_STEPS", "100"))
SLEEP = float(os.environ.get("WORKER_SLEEP", "0.03"))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    times = []
    for i in range(STEPS):
        t0 = time.perf_counter()
        x = torch.randn(256, generator=g)
        dist.all_reduce(x)
        out = [torch.empty(64) for _ in range(world)]
        dist.all_gather(out, torch.full((64,), float(rank + i)))
        b = torch.arange(32, dtype=torch.float32) * (i + 1)
        dist.broadcast(b, src=i % world)
        commcheck.step()
        times.append(time.perf_counter() - t0)
        time.sleep(SLEEP)
    if os.environ.get("WORKER_TIMES"):
        with open(os.path.join(os.environ["WORKER_TIMES"], f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(f"{t:.6f}" for t in times))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
