"""Collectives inside ``torch.compile`` graphs (Inductor's generated code calling the
``_c10d_functional`` ops), end to end: a tensor-parallel MLP compiled under torchrun (gloo,
2 ranks), a real collector and its report.

One job trains the model compiled, unpatched and then patched, in one process (see the
worker): the patched run's records, and both runs' losses and graph-break counts. A second
job flips a bit on rank 1 inside a compiled all-reduce (below commcheck, as in the spine
tests)."""

from __future__ import annotations

import json

import pytest

from ..harness import WORKERS, call_lines, report_json, run_job, start_collector
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKER = WORKERS / "compiled_tp.py"
SITE = f"compiled_tp.py:{call_lines(WORKER)['down']} forward"
STEPS = 6


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> str:
    """Inductor's cache for this module's jobs alone: a cached graph keeps the source
    stack of the compile that filled it, which must be the worker's as it is now."""
    return str(tmp_path_factory.mktemp("inductor"))


def _job(tmp_path, cache: str, **env: str) -> tuple[dict | None, dict, object]:
    col = start_collector(tmp_path, 2, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": tmp_path.name,
           "WORKER_STEPS": str(STEPS), "TORCHINDUCTOR_CACHE_DIR": cache, **env}
    results = run_job(WORKER, env, nnodes=1, nproc=2)
    for r in results:
        assert r.returncode == 0, r.stdout[-4000:]
    col.wait()
    result = None
    for line in results[0].stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
    _, doc = report_json(col.db)
    return result, doc, col.db


@pytest.fixture(scope="module")
def clean(tmp_path_factory, inductor_cache):
    return _job(tmp_path_factory.mktemp("compiled_clean"), inductor_cache, WORKER_PLAIN="1")


def test_every_compiled_all_reduce_is_verified_at_the_users_line(clean):
    _, doc, db = clean
    s = doc["summary"]
    assert doc["findings"] == []
    assert s["bypassed"] == {}
    assert s["ops"] == [{"op": "all_reduce", "recorded": 2 * STEPS, "verified": STEPS}]
    assert s["not_checked_on_ranks"] == 0
    with stored(db) as conn:
        rows = conn.execute("SELECT rank, step, callsite FROM records WHERE t_done > 0 "
                            "ORDER BY rank, seq").fetchall()
    assert rows == [(r, step, SITE) for r in (0, 1) for step in range(STEPS)]


def test_patching_changes_neither_losses_nor_graph_breaks(clean):
    result, _, _ = clean
    plain, checked = result["plain"], result["checked"]
    assert len(checked["losses"]) == STEPS
    assert checked["losses"] == plain["losses"]  # bit for bit (hex floats)
    assert plain["graph_breaks"] >= 1  # the worker's deliberate break: counting works
    assert checked["graph_breaks"] == plain["graph_breaks"]
    assert checked["graphs"] == plain["graphs"]


def test_a_bit_flipped_in_a_compiled_all_reduce_names_rank_step_and_line(tmp_path, clean,
                                                                         inductor_cache):
    _, doc, _ = _job(tmp_path, inductor_cache,
                     COMMCHECK_INJECT="bitflip:rank=1,op=all_reduce,call=3,bit=22")
    findings = doc["findings"]
    assert [(f["kind"], f["culprits"]) for f in findings] == [("value_mismatch", [1])], findings
    f = findings[0]
    assert f["op"] == "all_reduce"
    assert f["step"] == 2  # the third step, counted from 0
    assert f["callsite"] == SITE
    assert f["detail"].get("injected") is True
    assert doc["summary"]["bypassed"] == {}
