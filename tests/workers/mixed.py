"""A few hundred mixed collectives: several dtypes, a subgroup, async ops, every wrapped op.

Started by torchrun from the integration tests. Each call site carries a ``# CALL:name``
marker so tests can check the call site a finding names. Per iteration, the all_reduce
calls on a rank are f32, bf16, f16-max, i64, async, then (ranks 0, 1, 3) the subgroup one;
the all_gather_single calls are plain, alias, async.
"""

import os
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ITERS = int(os.environ.get("WORKER_ITERS", "20"))
SUB = [0, 1, 3]


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group(SUB)
    g = torch.Generator().manual_seed(100 + rank)
    for i in range(ITERS):
        x = torch.randn(1000 + i, generator=g)
        dist.all_reduce(x)  # CALL:ar_f32
        xb = torch.randn(257, generator=g).bfloat16()
        dist.all_reduce(xb)  # CALL:ar_bf16
        xh = torch.randn(64, generator=g).half()
        dist.all_reduce(xh, op=dist.ReduceOp.MAX)  # CALL:ar_f16_max
        xi = torch.randint(0, 100, (33,), generator=g)
        dist.all_reduce(xi)  # CALL:ar_i64
        y = torch.randn(4096, generator=g)
        work = dist.all_reduce(y, async_op=True)  # CALL:ar_async
        y2 = y * 2 if i % 2 else None
        work.wait()
        b = torch.randn(300, generator=g) if rank == i % world else torch.zeros(300)
        dist.broadcast(b, src=i % world)  # CALL:bc
        t = torch.randn(50 + i, generator=g)
        lst = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(lst, t)  # CALL:ag
        out = torch.empty(world * t.numel())
        dist.all_gather_single(out, t)  # CALL:ags
        out2 = torch.empty(world * t.numel())
        dist.all_gather_into_tensor(out2, t)  # CALL:agi
        out3 = torch.empty(world * t.numel(), dtype=torch.int32)
        ti = torch.randint(-5, 5, (t.numel(),), dtype=torch.int32, generator=g)
        fut = dist.all_gather_single(out3, ti, async_op=True).get_future()  # CALL:ag_async
        fut.wait()
        inp = torch.randn(world * 40, generator=g)
        o = torch.empty(40)
        dist.reduce_scatter_single(o, inp)  # CALL:rs
        if rank in SUB:
            s = torch.randn(128, generator=g)
            dist.all_reduce(s, group=sub)  # CALL:sub_ar
        del y2
        commcheck.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
