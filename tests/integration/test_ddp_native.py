"""commcheck's C++ DDP hook (commcheck/native/ddp_hook.cpp) against its Python hook: the
same records for the same bucket, bit for bit; the same findings from a real torchrun job,
on either path (``COMMCHECK_DDP_NATIVE=0`` forces the Python one); and the Python hook when
the extension cannot be built.

The extension is built once into the per-user cache before training (about a minute on a
loaded 2-core box; `make test` runs `commcheck build` first); every test and run loads it
from there."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from commcheck.native import ddphook
from commcheck.relay.link import dump_path
from commcheck.wire import (
    F_IN_SUMMARY,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    PHASE_COMPLETE,
    PHASE_ENTRY,
    decode,
    read_frames,
)

from ..harness import (
    WORKERS,
    call_lines,
    one_rank_world,
    report_json,
    run_job,
    start_collector,
)
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # the first build

WORKER = WORKERS / "ddp_native.py"
LINES = call_lines(WORKER)


@pytest.fixture(scope="module")
def built():
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja: the Python hook is the only path here")
    ddphook.build()  # before training, as `commcheck run` and `commcheck build` do
    assert ddphook.module() is not None, "the native DDP hook did not build (see the log)"


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    yield from one_rank_world(tmp_path, monkeypatch, "native", patch_first=True)


def _records(tmp_path) -> list[dict]:
    """Every ddp_allreduce record of the dump, its strings resolved."""
    out = []
    with open(dump_path(str(tmp_path), "native", 0), "rb") as f:
        for payload in read_frames(f):
            b = decode(payload)
            for r in b.records:
                d = {k: r[k].item() for k in r.dtype.names if k not in ("shape_off", "chunk_off")}
                for k in ("op", "dtype", "redop", "algo", "callsite"):
                    d[k] = b.strings[d[k]]
                name, ranks = b.env.groups[d["group"]]
                d["group"], d["shapes"] = (name, tuple(ranks)), b.ints(r)
                if d["op"] == "ddp_allreduce":
                    out.append(d)
    return out


def _backward(model: torch.nn.Module) -> None:
    torch.manual_seed(7)
    model(torch.randn(16, 64)).square().mean().backward()


def test_native_records_equal_the_python_hooks_for_the_same_buckets(built, one_rank, tmp_path,
                                                                     monkeypatch):
    """Two equal models, one on each path, one backward pass from the same line: two
    buckets each (one above 64 K floats, where the Python path takes the large-tensor
    kernel), entry and completion records equal in every field but seq and times."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model():
        torch.manual_seed(0)
        return DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                       torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)),
                   bucket_cap_mb=0.2)

    native = model()
    monkeypatch.setenv("COMMCHECK_DDP_NATIVE", "0")
    python = model()
    assert native._commcheck_slot.native is not None and python._commcheck_slot.native is None
    for m in (native, python):
        for _ in range(2):  # the second pass runs on the rebuilt buckets
            m.zero_grad()
            _backward(m)
    assert native._commcheck_slot.native.buckets == 3  # one bucket, then two
    assert all(torch.equal(a.grad, b.grad)
               for a, b in zip(native.parameters(), python.parameters(), strict=True))
    dist.destroy_process_group()
    # completions are written on gloo's thread: in seq order, entry first
    recs = sorted(_records(tmp_path), key=lambda r: (r["seq"], r["phase"] != PHASE_ENTRY))
    assert [(r["seq"], r["phase"]) for r in recs] == \
        [(s, p) for s in range(6) for p in (PHASE_ENTRY, PHASE_COMPLETE)]
    mine, theirs = recs[:6], recs[6:]
    times = ("seq", "t_enter", "t_exit", "t_done")
    for a, b in zip(mine, theirs, strict=True):
        assert {k: v for k, v in a.items() if k not in times} == \
            {k: v for k, v in b.items() if k not in times}
    done = [r for r in mine if r["phase"] != PHASE_ENTRY]
    assert {r["numel_in"] for r in done} == {16640 + 65792 + 2056, 65792 + 2056, 16640}
    assert all(r["flags"] == F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY and r["t_done"] > 0
               and r["algo"] == "xxh3-128" and r["redop"] == "SUM" for r in done)
    assert all(r["callsite"].endswith("_backward") for r in mine)


def test_the_python_hook_when_the_extension_cannot_be_built(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError, match="no C\\+\\+ compiler"):
        ddphook._load()
    monkeypatch.setenv("COMMCHECK_DDP_NATIVE", "0")
    assert ddphook.module() is None
    monkeypatch.delenv("COMMCHECK_DDP_NATIVE")
    ddphook._module.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, "commcheck"):
            assert ddphook.module() is None
        assert "the native DDP hook is unavailable (no C++ compiler" in caplog.text
        assert "checked by the Python hook" in caplog.text
    finally:
        ddphook._module.cache_clear()


def _job(tmp_path, **env: str):
    col = start_collector(tmp_path, 2, "--exit-when-done")
    results = run_job(WORKER, {"COMMCHECK_COLLECTOR": col.endpoint,
                               "COMMCHECK_RUN_ID": tmp_path.name, **env}, nnodes=1, nproc=2)
    for r in results:
        assert r.returncode == 0, r.stdout[-4000:]
    col.wait()
    _, doc = report_json(col.db)
    with stored(col.db) as conn:
        ops = conn.execute("SELECT op, callsite FROM records WHERE t_done > 0 AND rank = 0"
                           ).fetchall()
    # both ranks print to torchrun's one stdout: their lines may run into each other
    counts = [list(m) for m in re.findall(r"NATIVE (-?\d+) (-?\d+)", results[0].stdout)]
    return doc, ops, counts


@pytest.mark.parametrize(("poisoned", "clean"), [("native", "python"), ("python", "native")])
def test_a_nan_gradient_is_named_on_either_path_and_the_other_model_stays_clean(
        built, tmp_path, poisoned, clean):
    """One job, two equal models, one on each path: the model whose loss is NaN on rank 1
    at step 2 gives the only finding, at its own backward line; every bucket of both is
    verified, so the other path's run is the clean case."""
    doc, ops, counts = _job(tmp_path, NAN_AT=f"{poisoned}:1:2")
    assert counts == [["7", "-1"]] * 2  # one bucket, then two a step: all on the C++ hook
    assert [(f["kind"], f["op"], f["culprits"], f["step"]) for f in doc["findings"]] == \
        [("nan_inf", "ddp_allreduce", [1], 2)]
    assert doc["findings"][0]["callsite"].endswith(f"ddp_native.py:{LINES[poisoned]} main")
    sites = [site for op, site in ops if op == "ddp_allreduce"]
    assert len(sites) == 2 * 7 and \
        sites.count(f"ddp_native.py:{LINES[clean]} main") == 7
    assert doc["summary"]["verified"] == len(ops)
    # every bucket covered: only DDP's own construction traffic went past commcheck
    assert doc["summary"]["bypassed"] == doc["summary"]["bypassed_ddp"]
