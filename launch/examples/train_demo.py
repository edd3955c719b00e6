"""A small data-parallel training job for the demo: gloo, hand-rolled gradient all-reduce.

Started by torchrun. ``import commcheck; commcheck.patch()`` is all it takes; the rest is
an ordinary training loop (parameters broadcast from rank 0, gradients averaged with
all_reduce, a loss gathered for logging).
"""

import argparse
import os

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 8))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = torch.zeros(world)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        y = x[:, :8].sin()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        dist.all_gather_single(losses, loss.detach().reshape(1))
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  mean loss {losses.mean():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"training done on {world} ranks (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
