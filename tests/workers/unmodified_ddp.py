"""DDP training that knows nothing of commcheck. ``--flip RANK:STEP`` registers the
script's own comm hook (DDP's averaging all-reduce) that flips one mantissa bit of one
gradient element on that rank at that step (counting optimizer steps from 0); the
corrupted bucket is what DDP then copies into that rank's gradients."""

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 6


def flipping_hook(victim: int, at_step: int):
    def hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        world = dist.get_world_size()
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            if dist.get_rank() == victim and state["step"] == at_step:
                out = out.clone()
                out.view(torch.int32)[0] ^= 1 << 20
            return out

        return fut.then(done)

    return hook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flip", default="")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    state = {"step": 0}
    if args.flip:
        victim, at_step = (int(v) for v in args.flip.split(":"))
        model.register_comm_hook(state, flipping_hook(victim, at_step))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(STEPS):
        state["step"] = step
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # BACKWARD
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
