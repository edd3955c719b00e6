"""Fault-injection spec parsing and the pre-/post-call fault helpers (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from commcheck.rank.config import ConfigError
from commcheck.rank.inject import Fault, Injector, parse


def test_every_kind_parses_with_canonical_op_names():
    faults = parse("nan:rank=1,op=all_reduce,call=3,elem=2; skip:rank=3,op=all_gather,call=8;"
                   "shape:rank=2,op=all_reduce,call=5;chunk:rank=0,op=all_to_all,call=1,chunk=2;"
                   "p2p:rank=1,op=irecv,call=2,bit=7;bitflip:rank=0,op=ddp_allreduce,call=4;"
                   "swap:rank=3,op=all_gather_into_tensor,call=1")
    assert [(f.kind, f.op) for f in faults] == [
        ("nan", "all_reduce"), ("skip", "all_gather"), ("shape", "all_reduce"),
        ("chunk", "all_to_all"), ("p2p", "recv"), ("bitflip", "ddp_allreduce"),
        ("swap", "all_gather_single")]
    assert faults[0].elem == 2 and faults[3].chunk == 2 and faults[4].bit == 7
    assert [f.before for f in faults] == [True, True, True, False, False, False, False]
    assert parse("") == [] and parse(" ; ") == []


@pytest.mark.parametrize("spec, message", [
    ("melt:rank=0,op=all_reduce,call=1", "unknown fault kind"),
    ("nan:rank=0,op=all_reduce", "lacks call"),
    ("nan:rank=x,op=all_reduce,call=1", "not an integer"),
    ("nan:rank=0,op=all_reduce,call=1,color=3", "bad item"),
    ("nan:rank=0,op=frobnicate,call=1", "unknown op"),
    ("chunk:rank=0,op=all_reduce,call=1", "chunked output"),
    ("swap:rank=0,op=broadcast,call=1", "chunked output"),
    ("p2p:rank=0,op=send,call=1", "use op=recv"),
    ("nan:rank=0,op=recv,call=1", "needs an op with an input"),
    ("shape:rank=0,op=barrier,call=1", "needs an op with an input"),
])
def test_bad_specs_are_rejected_with_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse(spec)


def test_calls_count_per_canonical_op_and_only_on_the_named_rank():
    inj = Injector(parse("skip:rank=1,op=send,call=2;nan:rank=0,op=send,call=1"), rank=1)
    assert inj.count("send") == []
    assert [f.kind for f in inj.count("send")] == ["skip"]
    assert inj.count("send") == [] and inj.count("recv") == []


def test_nan_poisons_one_float_element_and_leaves_integers_alone():
    t = torch.ones(5)
    Injector.poison(Fault("nan", 0, "all_reduce", 1), t)
    assert math.isnan(float(t[2])) and int(torch.isnan(t).sum()) == 1
    i = torch.ones(5, dtype=torch.int64)
    Injector.poison(Fault("nan", 0, "all_reduce", 1), i)
    assert torch.equal(i, torch.ones(5, dtype=torch.int64))


def test_shape_narrows_a_view_by_one_element():
    t = torch.arange(12.0).reshape(4, 3)
    n = Injector.narrow(t)
    assert n.shape == (3, 3) and n.data_ptr() == t.data_ptr()
    assert Injector.narrow(torch.arange(5.0)).numel() == 4
    assert Injector.narrow(torch.arange(6.0).reshape(1, 6)).numel() == 5


def test_chunk_fault_hits_the_named_chunk_only():
    chunks = [torch.zeros(4) for _ in range(3)]
    Injector.apply(Fault("chunk", 0, "all_to_all", 1, chunk=1, bit=0), chunks, group_rank=0)
    assert [int(c.view(torch.int32).sum()) for c in chunks] == [0, 1, 0]


def test_a_fault_reads_back_as_written():
    for spec in ("bitflip:rank=2,op=all_reduce,call=21",
                 "bitflip:rank=2,op=all_reduce,call=21,bit=30,elem=3",
                 "swap:rank=0,op=all_gather,call=1,a=1,b=2"):
        [f] = parse(spec)
        assert str(f) == spec and parse(str(f)) == [f]


def test_a_fault_aimed_at_an_op_the_rank_never_recorded_is_named_with_what_it_did():
    from commcheck.rank.inject import why_unfired

    inj = Injector(parse("bitflip:rank=2,op=all_reduce,call=21;"
                         "bitflip:rank=2,op=ddp_allreduce,call=3"), rank=2)
    for _ in range(30):
        inj.count("ddp_allreduce")
    inj.count("barrier")
    [missed] = inj.unfired()
    assert str(missed) == "bitflip:rank=2,op=all_reduce,call=21"
    assert why_unfired(missed, inj.calls, world=4) == (
        "fault bitflip:rank=2,op=all_reduce,call=21 never fired: rank 2 recorded no "
        "all_reduce; it recorded ddp_allreduce ×30, barrier ×1")
    inj2 = Injector(parse("nan:rank=2,op=all_reduce,call=21"), rank=2)
    for _ in range(5):
        inj2.count("all_reduce")
    assert "rank 2 recorded 5 all_reduce;" in why_unfired(inj2.unfired()[0], inj2.calls, 4)
    far = parse("nan:rank=9,op=all_reduce,call=1")[0]
    assert "there is no rank 9 in a world of 4" in why_unfired(far, {}, 4)
