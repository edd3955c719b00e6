"""Calls through ``ProcessGroup`` methods are recorded under the ``dist`` names (or counted
as not checked, reason "ProcessGroup method"), change nothing torch computes, and a fault
in one of them is found; faults that never fire are said at exit and in the report."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from ..harness import WORKERS, commcheck_cmd, start_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
SCRIPT = WORKERS / "pgcalls.py"


def results(outs: list[subprocess.CompletedProcess]) -> dict[str, str]:
    found = {}
    for r in outs:
        assert r.returncode == 0, r.stdout[-3000:]
        for m in re.finditer(r"RESULT rank (\d+): (\[[^\]]*\])", r.stdout):
            found[m.group(1)] = m.group(2)
    return found


def analyze(tmp_path, dump) -> tuple[int, dict]:
    r = subprocess.run(commcheck_cmd("analyze", str(dump), "--db", str(tmp_path / "a.db"),
                                     "--json"), capture_output=True, text=True, timeout=120)
    return r.returncode, json.loads(r.stdout)


def _finish(procs) -> list[subprocess.CompletedProcess]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return outs


FAULT = "bitflip:rank=2,op=all_reduce,call=4,bit=30"  # pg.allreduce, rank 2's 4th all_reduce
UNFIRED = "bitflip:rank=1,op=broadcast,call=9;nan:rank=7,op=all_reduce,call=1"


@pytest.fixture(scope="module")
def pg_job(tmp_path_factory) -> tuple[dict[str, str], dict[str, str], str, int, dict]:
    """One patched job beside an unpatched one (side by side: nothing shared): a fault that
    fires in a ProcessGroup method, two that never fire. (unpatched results, patched
    results, patched output, analyze's status, its document)."""
    tmp = tmp_path_factory.mktemp("pg")
    dump = tmp / "dump"
    env = {"COMMCHECK_DUMP_DIR": str(dump), "COMMCHECK_RUN_ID": "pg",
           "COMMCHECK_INJECT": f"{FAULT};{UNFIRED}"}
    unpatched = start_job(SCRIPT, {"COMMCHECK_DISABLE": "1"}, nnodes=1, nproc=3)
    patched = start_job(SCRIPT, env, nnodes=1, nproc=3)
    plain, outs = results(_finish(unpatched)), _finish(patched)
    rc, doc = analyze(tmp, dump / "pg")
    return plain, results(outs), "".join(r.stdout for r in outs), rc, doc


def test_process_group_methods_are_recorded_and_change_nothing(pg_job):
    plain, patched, text, rc, doc = pg_job
    assert len(plain) == 3
    # every result the unpatched run's, but the one the fault flipped: rank 2's pg.allreduce
    # (the 4th value printed)
    assert {r: v for r, v in patched.items() if r != "2"} == \
        {r: v for r, v in plain.items() if r != "2"}
    mine, theirs = (v.strip("[]").split(", ") for v in (patched["2"], plain["2"]))
    assert mine[:3] + mine[4:] == theirs[:3] + theirs[4:] and mine[3] != theirs[3]
    s = doc["summary"]
    assert len(doc["findings"]) == 1 and rc == 1  # the fault's (next test); nothing else
    # 3 dist.all_reduce + allreduce, 2 broadcasts, allgather, reduce, barrier
    assert s["verified"] == 9
    assert s["not_checked_on_ranks"] == 3
    assert s["not_checked_reasons"] == {"ProcessGroup method": 3}
    assert s["bypassed"] == {}
    # the faults that never fired: said on the rank's stderr and in the report
    assert "fault bitflip:rank=1,op=broadcast,call=9 never fired: rank 1 recorded 2 " \
        "broadcast; it recorded all_reduce ×4, broadcast ×2" in text
    assert "there is no rank 7 in a world of 3" in text
    tallies = {t["rank"]: t for t in s["unfired_faults"]}
    assert tallies[1]["unfired"] == ["bitflip:rank=1,op=broadcast,call=9"]
    assert tallies[1]["recorded"]["all_reduce"] == 4
    assert tallies[0]["unfired"] == ["nan:rank=7,op=all_reduce,call=1"]
    assert 2 not in tallies  # rank 2's fault fired


def test_a_fault_in_a_process_group_method_is_found(pg_job):
    *_, rc, doc = pg_job
    assert rc == 1
    [f] = doc["findings"]
    assert (f["kind"], f["op"], f["seq"], f["culprits"]) == ("value_mismatch", "all_reduce",
                                                              3, [2])
    assert "pgcalls.py:" in f["callsite"] and "main" in f["callsite"]


def test_unpatch_restores_the_methods_and_calls_from_torch_record_once(tmp_path, monkeypatch):
    import socket

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    import commcheck
    from commcheck.native import hot
    from commcheck.rank import runtime

    before = {n: ProcessGroup.__dict__[n] for n in ("allreduce", "broadcast", "alltoall_base")}
    monkeypatch.setenv("COMMCHECK_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("COMMCHECK_RUN_ID", "unit")
    monkeypatch.delenv("COMMCHECK_COLLECTOR", raising=False)
    assert commcheck.patch()
    gate = getattr(hot.module(), "Gate", None)  # nested calls pass in C (native/gate.c)
    assert gate is None or {type(ProcessGroup.__dict__[n]) for n in before} == {gate}
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        session = runtime.active_session()
        t = torch.ones(4)
        dist.all_reduce(t)  # c10d calls pg.allreduce inside: still one call
        dist.group.WORLD.allreduce([t]).wait()
        dist.group.WORLD.allreduce([t, torch.ones(4)]).wait()  # two tensors: counted
        with dist._coalescing_manager():  # ends with pg.allreduce_coalesced: not counted
            dist.all_reduce(t)
        assert session.not_checked == 1
    finally:
        commcheck.unpatch()
        if dist.is_initialized():
            dist.destroy_process_group()
    from .test_patch import read_dump, records

    ops = [b.strings[r["op"]] for b, r in records(read_dump(tmp_path))]
    assert ops == ["all_reduce"] * 3
    assert {n: ProcessGroup.__dict__[n] for n in before} == before
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        t = torch.ones(4)
        dist.group.WORLD.allreduce([t]).wait()  # the restored method binds self again
        assert t.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()
