"""Collectives through ``ProcessGroup`` methods (as c10d's own tests make them) beside
``dist.*`` calls: three all_reduces, then pg.allreduce, pg.broadcast (both forms),
pg.allgather, pg.reduce, pg.barrier, and an alltoall_base that is only counted. Prints
each rank's results so a run with and without commcheck can be compared."""

from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    out = []
    for i in range(3):
        x = torch.arange(8, dtype=torch.float32) * (rank + i)
        dist.all_reduce(x)
        out.append(x.sum().item())
    t = torch.arange(8, dtype=torch.float32) + rank
    pg.allreduce([t]).wait()  # all_reduce call 4
    b = torch.full((8,), float(rank))
    opts = dist.BroadcastOptions()
    opts.rootRank = 1
    pg.broadcast([b], opts).wait()
    c = torch.full((4,), float(rank + 5))
    pg.broadcast(c, 0).wait()
    outs = [torch.empty(4) for _ in range(world)]
    pg.allgather([outs], [torch.full((4,), float(rank))]).wait()
    r = torch.ones(4) * (rank + 1)
    ropts = dist.ReduceOptions()
    ropts.rootRank = 0
    pg.reduce([r], ropts).wait()
    pg.barrier().wait()
    a2a_out = torch.empty(world)
    pg.alltoall_base(a2a_out, torch.arange(world, dtype=torch.float32) + 10 * rank,
                     [], [], dist.AllToAllOptions()).wait()
    out += [t.sum().item(), b.sum().item(), c.sum().item(),
            sum(o.sum().item() for o in outs), a2a_out.sum().item()]
    print(f"RESULT rank {rank}: {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
