"""Every recorded op once or more: c10d collectives, p2p, batch_isend_irecv, object
collectives, coalescing blocks, subgroups, a 2x2 DeviceMesh, functional collectives and
DTensor, DDP under ``commcheck.watch`` and FSDP2. Run by torchrun with 4 ranks.

``COVER_PARTS`` (comma separated, default all but ``plain``) picks sections; ``plain`` is
four chained plain all_reduces (each output feeds the next input), for a fault whose
evidence is the reduction itself (test_two_ranks). Each call site carries a
``# CALL:name`` marker. The worker checks a few results itself, so a wrapper that changed a
result fails the run. Expected complete-record counts per op: ``EXPECTED`` (for 4 ranks).
"""

import os
from datetime import timedelta

import torch.distributed as dist

ORIG_ISEND, ORIG_IRECV = dist.isend, dist.irecv  # bound before patch(), as frameworks do

import commcheck  # noqa: E402

commcheck.patch()

import torch  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

PARTS = set(filter(None, os.environ.get("COVER_PARTS", "c10d,p2p,objects,groups,funcol,"
                                                       "ddp,fsdp").split(",")))
ITERS = 2

# op -> complete records on all ranks together (4 ranks), per section
EXPECTED = {
    "c10d": {"reduce": 4 * 2 * ITERS, "gather": 4 * ITERS, "scatter": 4 * ITERS,
             "all_to_all": 4 * ITERS, "all_to_all_single": 4 * 3 * ITERS,
             "reduce_scatter": 4 * ITERS, "all_reduce_coalesced": 4 * 2 * ITERS,
             "all_gather_coalesced": 4 * ITERS, "barrier": 4 * ITERS,
             "monitored_barrier": 4 * ITERS, "all_reduce": 4 * 4 * ITERS,
             "all_gather_single": 4 * ITERS, "reduce_scatter_single": 4 * ITERS},
    # ring isend/irecv + sync pairs (0->1, 2->3) + anysource (3->0) + 2 batch rings
    "p2p": {"send": (4 + 2 + 1 + 8) * ITERS, "recv": (4 + 2 + 1 + 8) * ITERS},
}


def c10d_ops(rank: int, world: int, g: torch.Generator) -> None:
    for i in range(ITERS):
        root = i % world
        x = torch.randn(64, generator=g)
        dist.reduce(x, dst=root)  # CALL:reduce
        y = torch.randn(32, generator=g)
        dist.reduce(y, dst=root, async_op=True).wait()  # CALL:reduce_async
        t = torch.randn(16, generator=g)
        lst = [torch.empty(16) for _ in range(world)] if rank == root else None
        dist.gather(t, gather_list=lst, dst=root)  # CALL:gather
        if rank == root:
            assert torch.equal(lst[rank], t)
        out = torch.empty(8)
        src = [torch.full((8,), float(j)) for j in range(world)] if rank == root else None
        dist.scatter(out, scatter_list=src, src=root)  # CALL:scatter
        assert torch.equal(out, torch.full((8,), float(rank)))
        ins = [torch.full((5,), float(rank * 10 + j)) for j in range(world)]
        outs = [torch.empty(5) for _ in range(world)]
        dist.all_to_all(outs, ins)  # CALL:a2a
        assert [int(o[0]) for o in outs] == [j * 10 + rank for j in range(world)]
        a = torch.randn(world * 6, generator=g)
        b = torch.empty(world * 6)
        dist.all_to_all_single(b, a)  # CALL:a2as
        # uneven: rank r sends j+1 rows to rank j, so receives r+1 rows from everyone
        ua = torch.randn(sum(j + 1 for j in range(world)), 3, generator=g)
        ub = torch.empty(world * (rank + 1), 3)
        dist.all_to_all_single(ub, ua, output_split_sizes=[rank + 1] * world,  # CALL:a2as_split
                               input_split_sizes=[j + 1 for j in range(world)])
        wa = torch.randn(world * 4, generator=g)
        dist.all_to_all_single(torch.empty(world * 4), wa, async_op=True).wait()  # CALL:a2as_async
        rs_out = torch.empty(7)
        rs_list = [torch.randn(7, generator=g) for _ in range(world)]
        dist.reduce_scatter(rs_out, rs_list)  # CALL:rs_list
        c1, c2 = torch.randn(9, generator=g), torch.randn(4, generator=g)
        dist.all_reduce_coalesced([c1, c2])  # CALL:arc
        dist.all_reduce_coalesced([c1, c2], async_op=True).wait()  # CALL:arc_async
        g1, g2 = torch.randn(3, generator=g), torch.randn(2, generator=g)
        agc = [[torch.empty(3), torch.empty(2)] for _ in range(world)]
        dist.all_gather_coalesced(agc, [g1, g2])  # CALL:agc
        assert torch.equal(agc[rank][0], g1)
        base = torch.empty(world * 4)
        dist._all_gather_base(base, torch.randn(4, generator=g))  # CALL:ag_base
        rs_in = torch.randn(world * 4, generator=g)
        dist._reduce_scatter_base(torch.empty(4), rs_in)  # CALL:rs_base
        dist.barrier()  # CALL:barrier
        dist.monitored_barrier(timeout=timedelta(seconds=30))  # CALL:mbarrier
        s1, s2 = torch.randn(6, generator=g), torch.randn(6, generator=g)
        with dist._coalescing_manager():  # CALL:coalesced_block
            dist.all_reduce(s1)
            dist.all_reduce(s2)
        s3, s4 = torch.randn(5, generator=g), torch.randn(5, generator=g)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(s3)  # CALL:coalesced_async
            dist.all_reduce(s4)
        cm.wait()


def p2p_ops(rank: int, world: int, g: torch.Generator) -> None:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for _ in range(ITERS):
        s = torch.randn(12, generator=g)
        r = torch.empty(12)
        works = [dist.isend(s, dst=nxt), dist.irecv(r, src=prv)]  # CALL:ring
        for w in works:
            w.wait()
        if rank % 2 == 0:
            dist.send(torch.randn(10, generator=g), dst=rank + 1)  # CALL:send
        else:
            buf = torch.empty(10)
            assert dist.recv(buf, src=rank - 1) == rank - 1  # CALL:recv
        if rank == 3:
            dist.send(torch.randn(6, generator=g), dst=0)  # CALL:send_any
        elif rank == 0:
            assert dist.recv(torch.empty(6)) == 3  # CALL:recv_any
        for op_send, op_recv in ((dist.isend, dist.irecv), (ORIG_ISEND, ORIG_IRECV)):
            bs, br = torch.randn(7, generator=g), torch.empty(7)
            ops = [dist.P2POp(op_send, bs, nxt), dist.P2POp(op_recv, br, prv)]
            for w in dist.batch_isend_irecv(ops):  # CALL:batch
                w.wait()


def object_ops(rank: int, world: int) -> None:
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": {rank, "x"}})  # CALL:ago
    assert [o["rank"] for o in objs] == list(range(world))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(("g", rank), gathered, dst=0)  # CALL:go
    lst = [f"from{rank}", rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(lst, src=1)  # CALL:bol
    assert lst == ["from1", 1]
    out = [None]
    dist.scatter_object_list(out, [f"to{j}" for j in range(world)] if rank == 2 else None,
                             src=2)  # CALL:sol
    assert out == [f"to{rank}"]
    if rank == 0:
        dist.send_object_list([{"k": 1}, "v"], dst=3)  # CALL:sendobj
    elif rank == 3:
        got = [None, None]
        dist.recv_object_list(got, src=0)  # CALL:recvobj
        assert got == [{"k": 1}, "v"]


def group_ops(rank: int, world: int, g: torch.Generator) -> None:
    sub = dist.new_group([0, 1, 3])
    if rank in (0, 1, 3):
        dist.all_reduce(torch.randn(20, generator=g), group=sub)  # CALL:sub_ar
    else:  # outside the group: c10d warns and returns; commcheck records nothing
        dist.all_reduce(torch.randn(20, generator=g), group=sub)
    cur, _ = dist.new_subgroups(2)
    dist.all_reduce(torch.randn(11, generator=g), group=cur)  # CALL:subgroups_ar
    lst = [torch.empty(3) for _ in range(2)]
    dist.all_gather(lst, torch.randn(3, generator=g), group=cur)  # CALL:subgroups_ag
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    dist.all_reduce(torch.randn(13, generator=g), group=dp)  # CALL:mesh_dp
    out = torch.empty(2 * 5)
    dist.all_gather_into_tensor(out, torch.randn(5, generator=g), group=tp)  # CALL:mesh_tp
    dist.broadcast(torch.randn(4, generator=g), group=tp, group_src=1)  # CALL:mesh_bc


def funcol_ops(rank: int, world: int, g: torch.Generator) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    pg = dist.group.WORLD
    x = torch.randn(8, generator=g)
    y = funcol.all_reduce(x, "sum", pg)  # CALL:fc_ar
    z = y * 1  # first use waits
    ref = x.clone()
    dist.all_reduce(ref)
    assert torch.equal(z, ref)
    ag = funcol.all_gather_single(torch.full((2, 3), float(rank)), 1, pg)  # CALL:fc_ag
    assert ag.shape == (2, 3 * world) and float(ag[0, 3 * world - 1]) == world - 1
    rs_in = torch.randn(world * 4, generator=g)
    rs = funcol.reduce_scatter_single(rs_in, "sum", 0, pg)  # CALL:fc_rs
    rs.wait()
    parts = [torch.randn(5, generator=g), torch.randn(2, 3, generator=g)]
    summed = funcol.all_reduce_coalesced(parts, "sum", pg)  # CALL:fc_arc
    gathered = funcol.all_gather_single_coalesced(parts, pg)  # CALL:fc_agc
    assert (summed[1] * 1).shape == (2, 3) and (gathered[0] * 1).shape == (5 * world,)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(world * 6, dtype=torch.float32).reshape(world * 2, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])  # CALL:dt_dist
    assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full)  # CALL:dt_ag


def ddp_train(rank: int, g: torch.Generator) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets once rebuilt after step 1
    assert commcheck.watch(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(16, 32, generator=g)).square().mean().backward()  # CALL:ddp
        opt.step()


def fsdp_train(rank: int, g: torch.Generator) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()  # CALL:fsdp
        opt.step()


def plain_ops(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(7 + rank)  # tests/workers/faults.py's values
    state = torch.zeros(256)
    for _ in range(4):
        x = state + torch.randn(256, generator=g)
        dist.all_reduce(x)  # CALL:plain_ar
        state = x / world


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(10 + rank)
    if "plain" in PARTS:
        plain_ops(rank, world)
    if "c10d" in PARTS:
        c10d_ops(rank, world, g)
    if "p2p" in PARTS:
        p2p_ops(rank, world, g)
    if "objects" in PARTS:
        object_ops(rank, world)
    if "groups" in PARTS:
        group_ops(rank, world, g)
    if "funcol" in PARTS:
        funcol_ops(rank, world, g)
    if "ddp" in PARTS:
        ddp_train(rank, g)
    if "fsdp" in PARTS:
        fsdp_train(rank, g)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
