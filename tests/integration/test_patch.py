"""Rule 1 on a real single-rank gloo group: same results, same exceptions, same Work
behaviour; unpatch restores every original; records written to a dump file carry what the
issue asks for."""

from __future__ import annotations

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import commcheck
from commcheck.rank.fingerprint import hash_cpu
from commcheck.relay.link import dump_path
from commcheck.wire import (
    F_ASYNC,
    F_IN_HASH,
    F_IN_SUMMARY,
    F_INJECTED,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    GOODBYE,
    HELLO,
    PHASE_COMPLETE,
    decode,
    read_frames,
)

pytestmark = pytest.mark.timeout(60)
NAMES = ["all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
         "broadcast", "reduce_scatter_single", "reduce_scatter_tensor", "init_process_group",
         "destroy_process_group"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0,
                            world_size=1)


@pytest.fixture
def patched(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMCHECK_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("COMMCHECK_RUN_ID", "unit")
    monkeypatch.setenv("COMMCHECK_HOST", "hostA")
    monkeypatch.delenv("COMMCHECK_COLLECTOR", raising=False)
    assert commcheck.patch()
    yield tmp_path
    commcheck.unpatch()
    if dist.is_initialized():
        dist.destroy_process_group()


def read_dump(tmp_path):
    with open(dump_path(str(tmp_path), "unit", 0), "rb") as f:
        return [decode(x) for x in read_frames(f)]


def records(batches, phase=PHASE_COMPLETE):
    out = []
    for b in batches:
        for row in b.records:
            if int(row["phase"]) == phase:
                out.append((b, row))
    return out


def test_unpatch_restores_every_original(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMCHECK_DUMP_DIR", str(tmp_path))
    before = {(m.__name__, n): getattr(m, n) for m in (dist, c10d) for n in NAMES}
    assert commcheck.patch() and commcheck.patch()  # idempotent
    for (mod, name), fn in before.items():
        now = getattr(dist if mod == dist.__name__ else c10d, name)
        assert now is not fn, (mod, name)
    commcheck.unpatch()
    commcheck.unpatch()
    after = {(m.__name__, n): getattr(m, n) for m in (dist, c10d) for n in NAMES}
    assert after == before
    assert not commcheck.is_patched()


def test_disable_and_bad_config_leave_torch_untouched(monkeypatch):
    original = dist.all_reduce
    monkeypatch.setenv("COMMCHECK_DISABLE", "1")
    with pytest.warns(UserWarning, match="disabled"):
        assert commcheck.patch() is False
    monkeypatch.delenv("COMMCHECK_DISABLE")
    monkeypatch.setenv("COMMCHECK_INJECT", "melt:rank=0")
    with pytest.warns(UserWarning, match="unknown fault kind"):
        assert commcheck.patch() is False
    assert dist.all_reduce is original


def test_results_and_exceptions_match_the_unpatched_calls(patched):
    _init()
    x = torch.arange(10.0)
    dist.all_reduce(x)
    assert torch.equal(x, torch.arange(10.0))
    out = torch.empty(6)
    dist.all_gather_into_tensor(out[:3], torch.ones(3))
    assert torch.equal(out[:3], torch.ones(3))
    assert dist.broadcast(x, src=0) is None
    with pytest.raises(Exception) as patched_err:
        dist.all_reduce("not a tensor")
    with pytest.raises(Exception) as orig_err:
        dist.all_reduce.__commcheck_original__("not a tensor")
    assert type(patched_err.value) is type(orig_err.value)
    assert str(patched_err.value) == str(orig_err.value)


def test_async_work_is_a_work_and_hashes_at_completion(patched):
    _init()
    x = torch.ones(4)
    work = dist.all_reduce(x, async_op=True)
    assert isinstance(work, dist.Work)
    assert work.wait() is True and work.is_completed() and work.is_success()
    fut = dist.all_gather_single(torch.empty(4), x, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.ones(4))
    dist.destroy_process_group()
    rows = records(read_dump(patched))
    assert len(rows) == 2
    assert all(int(r["flags"]) & F_ASYNC for _, r in rows)
    assert (int(rows[0][1]["out_h0"]), int(rows[0][1]["out_h1"])) == hash_cpu(torch.ones(4))


def test_one_user_call_one_record_with_all_fields(patched):
    _init()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.step()
    commcheck.step()
    out = torch.empty(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, torch.full((3,), 2.0))  # alias → one record
    line = test_one_user_call_one_record_with_all_fields.__code__.co_firstlineno + 8
    dist.reduce_scatter_single(torch.empty(2), torch.ones(2), op=dist.ReduceOp.SUM)
    dist.destroy_process_group()
    batches = read_dump(patched)
    assert batches[0].env.kind == HELLO and batches[-1].env.kind == GOODBYE
    assert batches[-1].env.counters["dropped"] == 0
    rows = records(batches)
    assert len(rows) == 2
    b, r = rows[0]
    s = b.strings
    assert (b.env.run, b.env.rank, b.env.host, b.env.world) == ("unit", 0, "hostA", 1)
    assert s[r["op"]] == "all_gather_single"
    assert s[r["dtype"]] == "float32" and s[r["algo"]] == "xxh3-128"
    assert s[r["callsite"]].startswith(f"{__file__}:{line} ")
    assert int(r["step"]) == 2
    assert r["t_enter"] <= r["t_exit"] <= r["t_done"]
    assert b.shape(r, 0) == (3,) and b.shape(r, 1) == (3,)
    assert r["in_sum"] == 6.0 and r["in_absmax"] == 2.0
    assert int(r["flags"]) & (F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH) == \
        F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH
    assert not int(r["flags"]) & F_OUT_SUMMARY  # gathered outputs are checked by hash only
    rs = rows[1][1]
    assert int(rs["flags"]) & F_OUT_SUMMARY and not int(rs["flags"]) & F_IN_HASH
    assert int(r["chunk_n"]) == 1 and int(rows[1][1]["seq"]) == 1
    assert s[rows[1][1]["redop"]] == "SUM"


def test_injection_corrupts_the_output_and_marks_the_record(monkeypatch, patched):
    commcheck.unpatch()  # re-patch with an inject spec
    monkeypatch.setenv("COMMCHECK_INJECT", "bitflip:rank=0,op=all_reduce,call=2,bit=31")
    assert commcheck.patch()
    _init()
    a, b = torch.ones(3), torch.ones(3)
    dist.all_reduce(a)
    dist.all_reduce(b)
    assert torch.equal(a, torch.ones(3))
    assert torch.equal(b, torch.tensor([1.0, -1.0, 1.0]))  # sign bit of the middle element
    dist.destroy_process_group()
    flags = [int(r["flags"]) & F_INJECTED for _, r in records(read_dump(patched))]
    assert flags == [0, F_INJECTED]
