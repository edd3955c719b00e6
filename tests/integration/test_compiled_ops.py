"""The ``_c10d_functional`` ops as compiled code calls them, on a real single-rank gloo group:
each one recorded once under its canonical name, results unchanged, a graph compiled
before ``patch()`` checked after it, and ``unpatch()`` putting torch's dispatch back."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commcheck
from commcheck.rank.fingerprint import hash_cpu

from .test_patch import _init, patched, read_dump, records  # noqa: F401

pytestmark = pytest.mark.timeout(120)
OPS = torch.ops._c10d_functional


def _calls(g: str) -> list[tuple[str, object]]:
    """(canonical name, the op called and waited as Inductor's code does) per op."""
    x = torch.arange(6.0)
    w = OPS.wait_tensor
    return [
        ("all_reduce", lambda: w(OPS.all_reduce(x, "sum", g))),
        ("all_reduce", lambda: w(OPS.all_reduce_(x.clone(), "sum", g))),
        ("all_reduce_coalesced",
         lambda: [w(t) for t in OPS.all_reduce_coalesced([x, x], "sum", g)]),
        ("all_gather_single", lambda: w(OPS.all_gather_into_tensor(x, 1, g))),
        ("all_gather_single",
         lambda: w(OPS.all_gather_into_tensor_out(x, 1, g, out=torch.empty(6)))),
        ("all_gather_single_coalesced",
         lambda: [w(t) for t in OPS.all_gather_into_tensor_coalesced([x, x], 1, g)]),
        ("reduce_scatter_single", lambda: w(OPS.reduce_scatter_tensor(x, "sum", 1, g))),
        ("reduce_scatter_single",
         lambda: w(OPS.reduce_scatter_tensor_out(x, "sum", 1, g, out=torch.empty(6)))),
        ("reduce_scatter_single_coalesced",
         lambda: [w(t) for t in OPS.reduce_scatter_tensor_coalesced([x], "sum", 1, g)]),
        ("all_to_all_single", lambda: w(OPS.all_to_all_single(x, [6], [6], g))),
        ("broadcast", lambda: w(OPS.broadcast(x, 0, g))),
        ("broadcast", lambda: w(OPS.broadcast_(x.clone(), 0, g))),
    ]


def test_every_functional_op_is_recorded_once_and_returns_what_torch_returns(
        patched):  # noqa: F811
    _init()
    g = dist.group.WORLD.group_name
    assert torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::all_reduce",
                                                          "BackendSelect")
    calls = _calls(g)
    got = [fn() for _, fn in calls]
    commcheck.unpatch()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::all_reduce",
                                                              "BackendSelect")
    want = [fn() for _, fn in _calls(g)]
    for a, b in zip(got, want, strict=True):
        assert [t.tolist() for t in a] == [t.tolist() for t in b] if isinstance(a, list) \
            else torch.equal(a, b)
    rows = records(read_dump(patched))
    assert [b.strings[r["op"]] for b, r in rows] == [name for name, _ in calls]
    assert [int(r["seq"]) for _, r in rows] == list(range(len(calls)))
    b, r = rows[0]
    assert (int(r["out_h0"]), int(r["out_h1"])) == hash_cpu(torch.arange(6.0))
    assert b.strings[r["redop"]] == "SUM"
    goodbye = read_dump(patched)[-1].env.counters
    assert goodbye["bypassed"] == 0 and goodbye["internal_errors"] == 0


def test_a_graph_compiled_before_patch_is_checked_at_its_traced_line(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMCHECK_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("COMMCHECK_RUN_ID", "unit")
    monkeypatch.delenv("COMMCHECK_COLLECTOR", raising=False)
    monkeypatch.delenv("COMMCHECK_INJECT", raising=False)
    _init()
    # Inductor's caches keep the source stack of the compile that filled them: compile
    # afresh, so that the line asked for is this file's as it is now
    fresh = (torch._inductor.config.patch(fx_graph_cache=False),
             torch._functorch.config.patch(enable_autograd_cache=False))
    try:
        for cfg in fresh:
            cfg.__enter__()
        torch._dynamo.reset()

        def f(x):
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

        line = f.__code__.co_firstlineno + 1
        compiled = torch.compile(f)
        x = torch.arange(4.0)
        before = compiled(x)
        assert commcheck.patch()
        during = compiled(x)
        commcheck.unpatch()
        after = compiled(x)
    finally:
        for cfg in fresh:
            cfg.__exit__(None, None, None)
        commcheck.unpatch()
        dist.destroy_process_group()
        torch._dynamo.reset()
    assert torch.equal(before, during) and torch.equal(during, after)
    rows = records(read_dump(tmp_path))
    assert len(rows) == 1  # the run while patched only
    b, r = rows[0]
    assert b.strings[r["op"]] == "all_reduce"
    assert b.strings[r["callsite"]] == f"{__file__}:{line} f"
    assert (int(r["out_h0"]), int(r["out_h1"])) == hash_cpu(x * 2)
