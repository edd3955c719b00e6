"""A job with a straggler, or a pipeline, for the straggler tests.

Default: ``STRAG_STEPS`` steps of four collectives (all_reduce, all_gather, broadcast,
all_reduce), ~20 ms of sleep ("compute") each; rank ``STRAG_RANK`` spins an extra
``STRAG_EXTRA`` seconds per step in steps ``STRAG_FROM`` to ``STRAG_TO`` (exclusive) and
writes the wall time it started spinning to ``STRAG_MARK``/onset.

``STRAG_PIPELINE=1``: two stages; each step rank 0 computes, sends activations to rank 1,
which waits for them (the schedule's skew), computes and sends gradients back; then both
all_reduce the loss (stage 0 always arrives last there, by design).
"""

import os
import time
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = int(os.environ.get("STRAG_STEPS", "100"))
SLOW = int(os.environ.get("STRAG_RANK", "-1"))
FROM, TO = int(os.environ.get("STRAG_FROM", "20")), int(os.environ.get("STRAG_TO", "60"))
EXTRA = float(os.environ.get("STRAG_EXTRA", "0.1"))
MARK = os.environ.get("STRAG_MARK", "")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def steps(rank: int, world: int) -> None:
    x = torch.ones(256)
    for i in range(STEPS):
        time.sleep(0.02)
        if rank == SLOW and FROM <= i < TO:
            if i == FROM and MARK:
                with open(os.path.join(MARK, "onset"), "w") as f:
                    f.write(repr(time.time()))
            spin(EXTRA)
        dist.all_reduce(x)
        out = [torch.empty(64) for _ in range(world)]
        dist.all_gather(out, torch.full((64,), float(rank + i)))
        dist.broadcast(x, src=i % world)
        dist.all_reduce(x)
        x = torch.ones(256)
        commcheck.step()


def pipeline(rank: int) -> None:
    act, grad, loss = torch.zeros(1024), torch.zeros(1024), torch.ones(1)
    for _ in range(STEPS):
        if rank == 0:
            spin(0.03)  # forward of stage 0
            dist.send(torch.ones(1024), dst=1)
            dist.recv(grad, src=1)
            spin(0.03)  # backward of stage 0
        else:
            dist.recv(act, src=0)
            spin(0.01)
            dist.send(torch.ones(1024), dst=0)
        dist.all_reduce(loss)
        loss = torch.ones(1)
        commcheck.step()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("STRAG_PIPELINE") == "1":
        pipeline(rank)
    else:
        steps(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
