"""A small data-parallel training job for the demo: gloo, hand-rolled gradient all-reduce.

``--device cuda`` puts it on GPUs (``--backend nccl``, or gloo with every rank on one GPU):
the device checks of launch/tools/device_check.sh.

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

# torch before 2.12 names it all_gather_into_tensor (commcheck records both as all_gather_single)
gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = ap.parse_args()

    dev = torch.device("cpu")
    if args.device == "cuda":  # gloo shares one GPU among ranks; NCCL needs one each
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 8)).to(dev)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = torch.zeros(world, device=dev)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen).to(dev)
        y = x[:, :8].sin()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if dev.type == "cuda" and args.backend == "gloo":  # gloo gathers a GPU list only
            dist.all_gather(list(losses.chunk(world)), loss.detach().reshape(1))
        else:
            gather_single(losses, loss.detach().reshape(1))
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  mean loss {losses.mean():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"training done on {world} ranks (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
