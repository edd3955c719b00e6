"""DDP checked by default: models built after ``patch()`` are watched without ``watch()``,
comm hooks registered in either order (Python or built-in) keep working and are checked
once per bucket, the used-parameter map is recorded, and torch's own errors pass unchanged.

The torchrun tests run tests/workers/ddp_hooks.py against a real collector; the error
tests run in-process on a one-rank gloo group, with and without ``patch()``."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import torch.distributed as dist

import commcheck
from commcheck.engine.verdicts import compressed_tolerance
from commcheck.wire import F_IN_SUMMARY, F_OUT_SUMMARY

from ..harness import (
    WORKERS,
    call_lines,
    commcheck_cmd,
    one_rank_world,
    report_json,
    run_job,
    start_collector,
)
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKER = WORKERS / "ddp_hooks.py"
BACKWARD = call_lines(WORKER)["backward"]


def _run(tmp_path, env: dict[str, str], nproc: int, nnodes: int = 1):
    col = start_collector(tmp_path, nnodes * nproc, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": tmp_path.name, **env}
    results = run_job(WORKER, env, nnodes=nnodes, nproc=nproc)
    for r in results:
        assert r.returncode == 0, r.stdout[-4000:]
    rc, _, _ = col.wait()
    _, doc = report_json(col.db)
    text = subprocess.run(commcheck_cmd("report", str(col.db)), capture_output=True,
                          text=True, timeout=60).stdout
    return rc, doc, col.db, text, results[0].stdout


def _complete(db, rank: int) -> list[tuple[str, int, int]]:
    """(op, seq, step) of one rank's complete records, in seq order."""
    with stored(db) as conn:
        return conn.execute("SELECT op, seq, step FROM records WHERE t_done > 0 AND rank = ? "
                            "ORDER BY seq", (rank,)).fetchall()


def _brief(doc: dict) -> list:
    return [(f["kind"], f["op"], f["step"], f["culprits"]) for f in doc["findings"]]


def test_unwatched_ddp_is_verified_with_its_used_map_and_a_flipped_bucket_is_found(tmp_path):
    """No watch() anywhere: the buckets are checked; find_unused_parameters' map all-reduce
    is recorded; the only bypassed collectives are DDP's construction, and the report says
    so; rank 1's fifth bucket, corrupted, is named with its step."""
    rc, doc, db, text, _ = _run(tmp_path, {"DDP_MODE": "plain", "DDP_UNUSED": "1",
                                           "COMMCHECK_INJECT": "bitflip:rank=1,op=ddp_allreduce,"
                                                               "call=5"}, nproc=3)
    s = doc["summary"]
    assert rc == 1 and s["verified"] > 0
    ops = _complete(db, 1)
    buckets = [r for r in ops if r[0] == "ddp_allreduce"]
    maps = [r for r in ops if r[0] == "ddp_used_map"]
    buffers = [r for r in ops if r[0] == "ddp_buffers"]
    assert len(maps) == 5 and len(buckets) >= 5  # one map per step, after the last bucket
    assert len(buffers) == 2 * 5  # BatchNorm's float and int64 buffers, each forward
    assert s["verified"] == len(ops)  # every bucket and every map, nothing counted twice
    assert [f["kind"] for f in doc["findings"]] == ["value_mismatch"], _brief(doc)
    f = doc["findings"][0]
    assert (f["op"], f["culprits"], f["step"]) == ("ddp_allreduce", [1], buckets[4][2])
    assert f["callsite"].endswith(f"ddp_hooks.py:{BACKWARD} main")
    # construction only: the parameter check and the state broadcasts (no bucket rebuild
    # with find_unused_parameters)
    n = s["bypassed"]["0"]
    assert s["bypassed"] == s["bypassed_ddp"] == {"0": n} and 0 < n <= 4
    assert f"{n} collectives bypassed commcheck and were not checked (group 0: {n}): all " \
           "DDP's own C++ traffic" in text
    assert "watch()" not in text


def test_a_user_hook_in_either_order_is_checked_once_per_bucket(tmp_path):
    """The user's hook registered before watch() on node 0's two ranks, after it on node
    1's (one job, 4 ranks): it runs, its bucket is checked (its inner all_reduce is not
    recorded again: the orders would disagree on what was called), and the bit it flips on
    one rank of each order at one step is reported for that rank and that step."""
    rc, doc, db, _, _ = _run(tmp_path, {"DDP_MODE": "hook_watch,watch_hook",
                                        "FLIP": "2:3,1:2"}, nproc=2, nnodes=2)
    assert rc == 1
    assert sorted((f["kind"], f["op"], f["culprits"], f["step"]) for f in doc["findings"]) == \
        [("value_mismatch", "ddp_bucket", [1], 2), ("value_mismatch", "ddp_bucket", [2], 3)], \
        _brief(doc)
    ops = {rank: _complete(db, rank) for rank in (0, 2)}  # one rank of each order
    assert ops[0] == ops[2]
    assert {op for op, _, _ in ops[0]} == {"ddp_bucket", "ddp_buffers"}
    assert doc["summary"]["verified"] == len(ops[0])


def test_builtin_fp16_hook_counts_one_verified_collective_per_bucket(tmp_path):
    """FP16_COMPRESS registered on an auto-watched model: no error, a clean run, and the
    collectives verified are exactly the buckets the backend all-reduced."""
    rc, doc, db, text, out = _run(tmp_path, {"DDP_MODE": "fp16"}, nproc=2)
    assert rc == 0 and doc["findings"] == [], _brief(doc)
    ops = _complete(db, 0)
    assert {op for op, _, _ in ops} == {"ddp_bucket", "ddp_buffers"}
    assert doc["summary"]["verified"] == len(ops)
    # the backend's count, steps 2..4; the ranks share one stdout and an unbuffered print
    # writes its newline apart, so another rank's line may follow the number directly
    measured = int(re.search(r"MEASURED (\d+)", out).group(1))
    assert measured == sum(1 for _, _, st in ops if st >= 2)
    assert doc["summary"]["bypassed"] == doc["summary"].get("bypassed_ddp"), doc["summary"]
    assert "no findings" in text
    # each bucket's sums, the input's before the hook and the output's after (issue 29 part
    # 4): the mean of the inputs is each output's sum, within fp16's rounding
    with stored(db) as conn:
        rows = conn.execute("SELECT seq, rank, redop, flags, in_sum, in_absmax, out_sum, "
                            "numel_out FROM records WHERE op = 'ddp_bucket' AND t_done > 0 "
                            "ORDER BY seq, rank").fetchall()
    assert rows and len(rows) == 2 * len([op for op, _, _ in ops if op == "ddp_bucket"])
    sums = F_IN_SUMMARY | F_OUT_SUMMARY
    for (seq, _, redop, flags, in0, max0, out0, n), (_, _, _, _, in1, max1, out1, _) in \
            zip(rows[::2], rows[1::2], strict=True):
        assert redop == "AVG_FP16" and flags & sums == sums, rows[:2]
        tol = compressed_tolerance("float16", 2, n, max0 + max1)
        assert abs((in0 + in1) / 2 - out0) <= tol and out0 == out1, (seq, in0, in1, out0)


# -- torch's own errors, with and without patch() -------------------------------------------


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    yield from one_rank_world(tmp_path, monkeypatch, "ddp")


def _outcomes() -> list[tuple[str, str]]:
    """What torch makes of hooks it must reject, and of hooks in any order: (type, message)
    per case, "ok" where nothing was raised."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model():
        torch.manual_seed(0)
        return DDP(torch.nn.Linear(4, 2))

    def step(m):
        m(torch.ones(3, 4)).sum().backward()

    def not_a_future(state, bucket):
        return bucket.buffer()

    cases = {
        "not callable": lambda m: m.register_comm_hook(None, 5),
        "returns a tensor": lambda m: (m.register_comm_hook(None, not_a_future), step(m)),
        "two hooks": lambda m: (m.register_comm_hook(None, allreduce_hook),
                                m.register_comm_hook(None, allreduce_hook)),
        "two built-ins": lambda m: (
            m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS),
            m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)),
        "not a hook type": lambda m: m._register_builtin_comm_hook("fp16"),
        "hook, then watch": lambda m: (m.register_comm_hook(None, allreduce_hook),
                                       commcheck.watch(m), step(m)),
        "watch, then hook": lambda m: (commcheck.watch(m),
                                       m.register_comm_hook(None, allreduce_hook), step(m)),
        "built-in fp16": lambda m: (
            m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS), step(m)),
    }
    out = []
    for case in cases.values():
        try:
            case(model())
            out.append(("ok", ""))
        except Exception as e:
            out.append((type(e).__name__, re.sub(r"0x[0-9a-f]+", "0x?", str(e))))
    return out


def test_torch_errors_and_hook_orders_are_the_same_with_and_without_patch(one_rank, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # watch() without patch() warns; nothing else differs
        plain = _outcomes()
    assert commcheck.patch()
    patched = _outcomes()
    assert patched == plain
    kinds = [k for k, _ in plain]
    assert kinds[:2] == ["TypeError", "RuntimeError"] and kinds[-3:] == ["ok"] * 3
    assert "must return a torch.futures.Future" in plain[1][1]
