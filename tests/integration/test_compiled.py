"""Collectives of compiled training, end to end: one torchrun job of 4 ranks (gloo), a real
collector and its report. The worker trains three parts compiled, unpatched and then patched,
in one process: FSDP2 × TP on a 2-D mesh with each block compiled (compiled TP all-reduces,
FSDP2's eager all-gathers and reduce-scatters), DDP + ``torch.compile`` (the DDP optimizer,
three buckets) and DDP under compiled autograd.

One job start-up serves the clean checks and the fault checks: bits are flipped on rank 1
(below commcheck, as in the spine tests) only on the last FSDP2 × TP step, inside an eager
FSDP2 all-gather, an eager FSDP2 reduce-scatter and a compiled TP all-reduce of the
backward graph; the steps before it, and the DDP parts after it, are the clean run."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ..harness import WORKERS, call_lines, report_json, run_job, start_collector
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WORKER = WORKERS / "compiled_fsdp_tp.py"
LINES = call_lines(WORKER)
STEPS = 4  # per part: fsdp_tp steps 0-3, ddp 4-7, ca 8-11
LAST = STEPS - 1
RANKS = (0, 1, 2, 3)


def site(name: str, fn: str) -> str:
    return f"compiled_fsdp_tp.py:{LINES[name]} {fn}"


# rank 1, on the last FSDP2 x TP step: calls are counted per canonical op from 1 (each
# step: 4 all_gather_single, 2 reduce_scatter_single, 3 all_reduce). The verdicts are the
# eager ones for these faults (test_spine): a chunk of a gather corrupted on its way in,
# a reduce-scatter's result not the sum of its inputs, an all-reduce's output that differs.
FAULTS = {
    ("all_gather_single", site("fsdp", "forward")): ("call=13", "link_corruption"),
    ("reduce_scatter_single", site("backward", "train_fsdp_tp")): ("call=7", "reduction_error"),
    ("all_reduce", site("up", "forward")): ("call=12", "value_mismatch"),  # backward graph
}
INJECT = ";".join(f"bitflip:rank=1,op={op},{call},bit=22"
                  for (op, _), (call, _) in FAULTS.items())


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[dict[int, dict], dict, object]:
    tmp = tmp_path_factory.mktemp("compiled")
    col = start_collector(tmp, len(RANKS), "--exit-when-done")
    # Inductor's cache for this job alone: a cached graph keeps the source stack of the
    # compile that filled it, which must be the worker's as it is now
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": tmp.name,
           "WORKER_STEPS": str(STEPS), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
           "COMMCHECK_INJECT": INJECT, "WORKER_OUT": str(tmp)}
    (result,) = run_job(WORKER, env, nnodes=1, nproc=len(RANKS), timeout=540)
    assert result.returncode == 0, result.stdout[-4000:]
    col.wait()
    results = {r: json.loads((tmp / f"result{r}.json").read_text()) for r in RANKS}
    _, doc = report_json(col.db)
    return results, doc, col.db


def _records(db) -> list[tuple[int, int, str, str]]:
    with stored(db) as conn:
        return conn.execute("SELECT rank, step, op, callsite FROM records WHERE t_done > 0 "
                            "ORDER BY rank, seq").fetchall()


def test_fsdp2_x_tp_every_collective_checked_at_the_users_line(job):
    """Per rank and step: FSDP2's gathers (forward and backward) and reduce-scatters (eager),
    the TP all-reduces (compiled: forward and the backward graph), nothing else, nothing
    bypassed; every collective checked."""
    _, doc, db = job
    want = Counter({("all_gather_single", site("fsdp", "forward")): 2,
                    ("all_gather_single", site("backward", "train_fsdp_tp")): 2,
                    ("reduce_scatter_single", site("backward", "train_fsdp_tp")): 2,
                    ("all_reduce", site("down", "forward")): 2,
                    ("all_reduce", site("up", "forward")): 1})
    rows = _records(db)
    for rank in RANKS:
        for step in range(STEPS):
            got = Counter((op, cs) for r, s, op, cs in rows if (r, s) == (rank, step))
            assert got == want, (rank, step)
    s = doc["summary"]
    assert s["not_checked_on_ranks"] == 0
    ops = {o["op"]: (o["recorded"], o["verified"]) for o in s["ops"]}
    # collectives per op: 4 ranks' records / 2 ranks per group
    assert ops["all_gather_single"] == (64, 32)
    assert ops["reduce_scatter_single"] == (32, 16)
    assert ops["all_reduce"] == (48 + 48, 24 + 12)  # TP: 2 groups of 2; compiled autograd: 4


def test_a_bit_flipped_on_rank_1_names_rank_step_op_and_line(job):
    _, doc, _ = job
    findings = doc["findings"]
    got = {(f["op"], f["callsite"]): (f["kind"], f["culprits"], f["step"],
                                      f["detail"].get("injected")) for f in findings}
    assert len(findings) == len(FAULTS)
    assert got == {key: (kind, [1], LAST, True) for key, (_, kind) in FAULTS.items()}, findings


def test_patching_changes_neither_losses_nor_graph_breaks(job):
    results, _, _ = job
    for rank, r in results.items():
        for part in ("fsdp_tp", "ddp", "ca"):
            plain, checked = r["plain"][part], r["checked"][part]
            assert len(checked["losses"]) == STEPS
            # bit for bit (hex floats); the faults change the last FSDP2 x TP step's loss
            n = LAST if part == "fsdp_tp" else STEPS
            assert checked["losses"][:n] == plain["losses"][:n], (rank, part)
            assert (checked["graph_breaks"], checked["graphs"]) == \
                (plain["graph_breaks"], plain["graphs"]), (rank, part, plain, checked)
        assert r["plain"]["fsdp_tp"]["graph_breaks"] >= 1  # the deliberate break: counting works


def test_every_ddp_bucket_is_checked_once_never_twice(job):
    """DDP optimizer: one ``ddp_allreduce`` (commcheck's comm hook) per bucket the backend
    ran in ``backward`` (1 bucket on the first step, 3 after DDP's rebuild); compiled
    autograd: the Python reducer's all-reduces, traced into the backward graph, one
    ``all_reduce`` each. The only collectives not checked are DDP's own C++ traffic
    (construction, bucket rebuild), counted as such."""
    results, doc, db = job
    rows = _records(db)
    for rank in RANKS:
        ddp, ca = (results[rank]["checked"][p]["backward"] for p in ("ddp", "ca"))
        assert ddp == [1, 3, 3, 3] and ca == [3, 3, 3, 3]
        for i in range(STEPS):
            got = Counter(op for r, s, op, _ in rows if (r, s) == (rank, STEPS + i))
            assert got == Counter({"ddp_allreduce": ddp[i]}), (rank, i)
            got = Counter(op for r, s, op, _ in rows if (r, s) == (rank, 2 * STEPS + i))
            assert got == Counter({"all_reduce": ca[i]}), (rank, i)
    s = doc["summary"]
    assert s["bypassed"] == s["bypassed_ddp"] and sum(s["bypassed"].values()) > 0
    assert {f["op"] for f in doc["findings"]} == {op for op, _ in FAULTS}
