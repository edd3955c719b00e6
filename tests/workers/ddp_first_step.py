"""One rank's first DDP steps under ``patch()``, timed: ``SETUP <s>`` (the DDP wrapper, where
commcheck gives the reducer its hook), ``STEPS <s> <s> <s>`` (forward, backward, optimizer
step each) and ``HOOK native|python``: which DDP hook recorded the buckets."""

import os
import time

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 8))
    t0 = time.perf_counter()
    model = DDP(net)
    print(f"SETUP {time.perf_counter() - t0:.3f}", flush=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    steps = []
    for _ in range(int(os.environ.get("STEPS", "3"))):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
    print("STEPS " + " ".join(f"{s:.3f}" for s in steps), flush=True)
    native = model._commcheck_slot.native is not None
    print(f"HOOK {'native' if native else 'python'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
