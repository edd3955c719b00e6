"""Rule 1 for the newly covered paths on a real single-rank gloo group: coalescing blocks,
batch_isend_irecv with ops bound before patch(), functional collectives, torch.compile,
DDP hooks, skip/shape faults; and the entry records that precede every complete one."""

from __future__ import annotations

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commcheck
from commcheck.rank import coalescing, runtime
from commcheck.rank.cut import units
from commcheck.rank.fingerprint import hash_cpu
from commcheck.rank.prints import SidePrint
from commcheck.relay.link import dump_path
from commcheck.wire import F_INJECTED, PHASE_COMPLETE, PHASE_ENTRY, SIDE_OUT, decode, read_frames
from commcheck.wire.ops import Split

pytestmark = pytest.mark.timeout(120)
ORIG_ISEND = dist.isend


def _init() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)


@pytest.fixture
def patched(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMCHECK_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("COMMCHECK_RUN_ID", "unit")
    monkeypatch.delenv("COMMCHECK_COLLECTOR", raising=False)
    monkeypatch.delenv("COMMCHECK_INJECT", raising=False)

    def start(inject: str = ""):
        monkeypatch.setenv("COMMCHECK_INJECT", inject)
        assert commcheck.patch()
        _init()
        return runtime._active[0]

    yield start
    commcheck.unpatch()
    if dist.is_initialized():
        dist.destroy_process_group()


def rows(tmp_path):
    """(op, phase, row, batch) of every record in the dump, in order."""
    out = []
    with open(dump_path(str(tmp_path), "unit", 0), "rb") as f:
        for payload in read_frames(f):
            b = decode(payload)
            out.extend((b.strings[r["op"]], int(r["phase"]), r, b) for r in b.records)
    return out


def batches(tmp_path):
    with open(dump_path(str(tmp_path), "unit", 0), "rb") as f:
        return [decode(payload) for payload in read_frames(f)]


def complete(tmp_path):
    return [(op, r, b) for op, phase, r, b in rows(tmp_path) if phase == PHASE_COMPLETE]


def test_every_complete_record_follows_its_entry_record(patched, tmp_path):
    patched()
    dist.all_reduce(torch.ones(3))
    dist.barrier()
    dist.destroy_process_group()
    got = [(op, phase, int(r["seq"]), int(r["numel_in"])) for op, phase, r, _ in rows(tmp_path)]
    assert got == [("all_reduce", PHASE_ENTRY, 0, 3), ("all_reduce", PHASE_COMPLETE, 0, 3),
                   ("barrier", PHASE_ENTRY, 1, 0), ("barrier", PHASE_COMPLETE, 1, 0)]
    entry = rows(tmp_path)[0][2]
    assert entry["t_done"] == 0 and entry["chunk_n"] == 0 and entry["t_enter"] > 0


def test_coalescing_block_hashes_outputs_when_the_block_ends(patched, tmp_path):
    patched()
    a, b = torch.ones(4), torch.full((2,), 3.0)
    with dist._coalescing_manager():
        dist.all_reduce(a)
        dist.all_reduce(b)
    c = torch.ones(5)
    with dist._coalescing_manager(async_ops=True) as cm:
        assert dist.all_reduce(c, async_op=True) is not None
    cm.wait()
    with pytest.raises(ZeroDivisionError), dist._coalescing_manager():
        dist.all_reduce(torch.ones(1))
        1 / 0  # noqa: B018
    dist.distributed_c10d._world.pg_coalesce_state.clear()  # c10d leaves it behind on errors
    session = runtime._active[0]
    dist.destroy_process_group()
    recs = complete(tmp_path)
    assert [(op, (int(r["out_h0"]), int(r["out_h1"]))) for op, r, _ in recs] == [
        ("all_reduce", hash_cpu(a)), ("all_reduce", hash_cpu(b)), ("all_reduce", hash_cpu(c))]
    assert session.not_checked == 1  # the call in the block that raised


def test_batch_isend_irecv_accepts_ops_bound_before_patch(patched, tmp_path):
    session = patched()
    assert dist.isend is not ORIG_ISEND
    t = torch.arange(3.0)
    ops = [dist.P2POp(ORIG_ISEND, t, 0), dist.P2POp(dist.irecv, torch.empty(3), 0)]
    seen = []
    shim = coalescing.batch_isend_irecv(seen.append, {ORIG_ISEND: dist.isend}, session)
    shim(ops)  # (gloo cannot send to itself: check what c10d would be handed)
    assert [p.op for p in seen[0]] == [dist.isend, dist.irecv]
    assert seen[0][0].tensor is t and seen[0][0].peer == 0 and seen[0][0].group is ops[0].group
    assert ops[0].op is ORIG_ISEND  # the caller's P2POp is untouched
    assert dist.batch_isend_irecv.__commcheck_original__ is not None


def test_functional_collective_is_recorded_when_waited(patched, tmp_path):
    patched()
    x = torch.arange(6.0).reshape(2, 3)
    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    assert isinstance(y, funcol.AsyncCollectiveTensor)
    assert torch.equal(y + 0, x)
    z = funcol.all_gather_single(x, 1, dist.group.WORLD)
    assert torch.equal(z.wait() if hasattr(z, "wait") else z, x)
    dist.destroy_process_group()
    recs = complete(tmp_path)
    assert [op for op, _, _ in recs] == ["all_reduce", "all_gather_single"]
    _, ar, b = recs[0]
    assert b.strings[ar["redop"]] == "SUM" and ar["out_sum"] == 15.0
    assert (int(ar["out_h0"]), int(ar["out_h1"])) == hash_cpu(x)


def test_compiled_collectives_run_unchanged_and_are_recorded(patched, tmp_path):
    """Compiled code calls the functional ops itself: commcheck's kernels at the dispatcher
    record them (rank/compiled.py), as a direct ``torch.ops`` call."""
    session = patched()

    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return funcol.all_reduce(y, "sum", dist.group.WORLD) + 1

    x = torch.arange(4.0)
    dist.all_reduce(x.clone())
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), x * 2 + 1)
    assert torch.equal(compiled(x), x * 2 + 1)
    torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x, "sum", "0"))
    assert session.tally.unseen() == {}
    assert session.errors == 0
    dist.destroy_process_group()
    recs = complete(tmp_path)
    assert [op for op, _, _ in recs] == ["all_reduce"] * 6  # eager, 2 x 2 compiled, direct
    assert [r["out_sum"] for _, r, _ in recs[1:]] == [12.0] * 4 + [6.0]
    goodbye = [b for b in batches(tmp_path) if b.env.kind == "goodbye"][0]
    assert goodbye.env.counters["bypassed"] == 0


def test_every_wrapped_path_is_covered(patched, tmp_path):
    """What the wrappers see is not bypassed: nested, async, object, coalesced and p2p-free
    paths on a single rank leave the backend's work counter fully covered."""
    session = patched()
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.all_reduce(x, async_op=True).wait()
    dist.broadcast(x, 0)
    out = [None]
    dist.all_gather_object(out, {"a": 1})
    dist.all_reduce_coalesced([x, x.clone()])
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(x)
        dist.all_reduce(x.clone())
    cm.wait()
    funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
    sub = dist.new_group([0])
    dist.all_reduce(x, group=sub)
    dist.barrier()
    torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x, "sum", sub.group_name))
    assert session.tally.unseen() == {}
    # a caller below commcheck's dispatcher kernels (as a C++ extension calls the backend)
    with torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.BackendSelect)):
        torch.ops._c10d_functional.wait_tensor(  # in place: nothing allocated there
            torch.ops._c10d_functional.all_reduce_(x, "sum", sub.group_name))
    dist.destroy_process_group(sub)
    assert session.tally.unseen() == {sub.group_name: 1}


def test_skip_and_shape_faults(patched, tmp_path):
    patched("skip:rank=0,op=all_reduce,call=1;skip:rank=0,op=send,call=1;"
            "shape:rank=0,op=all_reduce,call=2")
    x = torch.ones(4)
    assert dist.all_reduce(x) is None  # skipped: never called
    w = dist.isend(torch.ones(1), dst=0)
    assert isinstance(w, dist.Work) and w.wait() and w.is_completed()
    y = torch.ones(4)
    dist.all_reduce(y)  # narrowed to 3 elements
    dist.destroy_process_group()
    recs = complete(tmp_path)
    assert len(recs) == 1
    _, r, _ = recs[0]
    assert int(r["seq"]) == 0 and int(r["numel_in"]) == 3 and int(r["flags"]) & F_INJECTED


def test_coalesced_units_hash_alike_on_both_ends():
    a, b = torch.arange(3.0), torch.arange(2.0)
    sent = SidePrint.take(0, units([a, b], Split.MANY, 2), None, hash=True, summary=True)
    got = units([[a.clone(), b.clone()], [a * 0, b * 0]], Split.LISTS, 2)
    recv = SidePrint.take(SIDE_OUT, got, [5, 7], hash=True, summary=True)
    h_sent, _, _ = sent.resolve()
    _, _, chunks = recv.resolve()
    assert (chunks[0].h0, chunks[0].h1) == h_sent and (chunks[1].h0, chunks[1].h1) != h_sent
    assert [c.index for c in chunks] == [5, 7]
    flat = units(torch.arange(12.0).reshape(2, 6), Split.FLAT, 3, dim=1)
    assert [u[0].tolist() for u in flat] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]],
                                             [[4, 5], [10, 11]]]
    by_sizes = units(torch.arange(6.0), Split.FLAT, 2, sizes=[1, 5])
    assert [u[0].numel() for u in by_sizes] == [1, 5]


def test_ddp_watch_keeps_numerics_and_never_drops_a_user_hook(patched, tmp_path, monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    monkeypatch.setenv("COMMCHECK_DDP", "0")  # only watch() watches
    patched()

    def grads(model):
        torch.manual_seed(3)
        model(torch.randn(4, 8)).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    plain = DDP(torch.nn.Linear(8, 2))
    watched = DDP(torch.nn.Linear(8, 2))
    watched.load_state_dict(plain.state_dict())
    assert commcheck.watch(watched) and commcheck.watch(watched)  # idempotent
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(watched), strict=True))

    calls = []

    def user_hook(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    custom = DDP(torch.nn.Linear(8, 2))
    custom.register_comm_hook(None, user_hook)  # after patch(): wrapped, still called
    assert commcheck.watch(custom)
    grads(custom)
    assert calls == [1]
    commcheck.unpatch()
    ops = [op for op, _, _ in complete(tmp_path)]
    assert ops.count("ddp_allreduce") == 1 and ops.count("ddp_bucket") == 1
    assert "all_reduce" not in ops  # the hook's all_reduce is its bucket's: recorded once
    early = DDP(torch.nn.Linear(8, 2))
    early.register_comm_hook(None, user_hook)  # before patch(): cannot be wrapped
    assert commcheck.patch()
    with pytest.warns(UserWarning, match="got its comm hook before commcheck could wrap"):
        assert commcheck.watch(early) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads(early)
    assert calls == [1, 1]


def test_unpatch_restores_shims_hooks_and_functional_collectives(monkeypatch, tmp_path):
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    monkeypatch.setenv("COMMCHECK_DUMP_DIR", str(tmp_path))
    targets = [(c10d, "_check_op"), (c10d, "_coalescing_manager"), (dist, "batch_isend_irecv"),
               (c10d, "isend"), (dist, "irecv"), (c10d, "all_to_all_single"),
               (dist, "monitored_barrier"), (funcol, "all_reduce"), (funcol, "wait_tensor"),
               (funcol, "all_gather_tensor"), (DDP, "register_comm_hook")]
    before = [getattr(obj, name) for obj, name in targets]
    assert commcheck.patch()
    assert all(getattr(o, n) is not b for (o, n), b in zip(targets, before, strict=True))
    commcheck.unpatch()
    assert all(getattr(o, n) is b for (o, n), b in zip(targets, before, strict=True))


def test_coalesced_functional_collectives_are_recorded_once_per_call(patched, tmp_path):
    session = patched()
    x, y = torch.arange(4.0), torch.ones(3)
    outs = funcol.all_reduce_coalesced([x, y], "sum", dist.group.WORLD)
    assert torch.equal(outs[1] + 0, y) and torch.equal(outs[0] + 0, x)  # both waited
    gathered = funcol.all_gather_single_coalesced([x, y], dist.group.WORLD)
    assert torch.equal(gathered[0] + 0, x)
    scattered = funcol.reduce_scatter_single_coalesced([x, y], "sum", [0, 0],
                                                       dist.group.WORLD)
    assert torch.equal(scattered[0] + 0, x)
    assert session.tally.unseen() == {} and session.not_checked == 0
    dist.destroy_process_group()
    recs = complete(tmp_path)
    assert [op for op, _, _ in recs] == ["all_reduce_coalesced", "all_gather_single_coalesced",
                                         "reduce_scatter_single_coalesced"]
    _, ar, _ = recs[0]
    assert ar["out_sum"] == 9.0
    assert (int(ar["out_h0"]), int(ar["out_h1"])) != (0, 0)
