"""The gradient probe's live check across data-parallel replicas (real DDP, gloo, 4 ranks
on 2 simulated nodes, real collector)."""

from __future__ import annotations

import pytest

from ..harness import WORKERS, report_json, run_job, start_collector

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PARAM = "module.2.weight"
NAN_PARAM = "module.0.weight"


def _run(tmp_path, **env):
    col = start_collector(tmp_path, 4, "--exit-when-done")
    results = run_job(WORKERS / "ddp_grad.py", {"COMMCHECK_COLLECTOR": col.endpoint,
                                                "DUMP": str(tmp_path / "dump"), **env})
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    col.wait()
    return report_json(col.db)[1]


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory) -> tuple[dict, object]:
    """One job for the fault and the clean run beside it: rank 2's gradient of PARAM
    perturbed at step 3; every other parameter, and PARAM before step 3, is the clean case."""
    tmp = tmp_path_factory.mktemp("perturbed")
    return _run(tmp, GRAD_PERTURB=f"2:3:{PARAM}"), tmp


def test_the_clean_part_of_the_run_has_no_divergence(perturbed):
    doc, tmp = perturbed
    # nothing on the other parameters, nothing before the fault, nothing but the two findings
    # of the perturbed one (the next test), and no NaN
    assert sorted((f["kind"], f["group"], f["step"]) for f in doc["findings"]) == [
        ("grad_divergence", f"grad:{PARAM}[0-3]", 3),
        ("param_divergence", f"param:{PARAM}[0-3]", 3)], doc["findings"]
    # 8 steps x 4 parameters x (gradient + parameter), and DDP's 8 buckets (checked by
    # default, no watch() in the worker)
    assert doc["summary"]["verified"] == 64 + 8
    assert (tmp / "dump" / "rank3" / "grad_summary_7.csv").exists()


def test_a_perturbed_gradient_names_rank_parameter_and_step(perturbed):
    doc, _ = perturbed
    by_kind = {f["kind"]: f for f in doc["findings"]}
    assert sorted(by_kind) == ["grad_divergence", "param_divergence"], doc["findings"]
    g = by_kind["grad_divergence"]
    assert (g["culprits"], g["group"], g["step"]) == ([2], f"grad:{PARAM}[0-3]", 3)
    assert g["hosts"] == ["node1"]
    p = by_kind["param_divergence"]
    assert (p["culprits"], p["group"], p["step"]) == ([2], f"param:{PARAM}[0-3]", 3)
    assert p["detail"]["later_steps"] == 4  # steps 4..7 stay diverged, folded


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory) -> list[dict]:
    """Two replicas (one node of 2 ranks): rank 1's gradient of PARAM perturbed at step 3,
    rank 0's of NAN_PARAM made NaN at step 6. One job, the findings of each told apart by
    their group. Its findings."""
    tmp = tmp_path_factory.mktemp("two")
    col = start_collector(tmp, 2, "--exit-when-done")
    for r in run_job(WORKERS / "ddp_grad.py", {"COMMCHECK_COLLECTOR": col.endpoint,
                                                "DUMP": str(tmp / "dump"),
                                                "GRAD_PERTURB": f"1:3:{PARAM}",
                                                "GRAD_NAN": f"0:6:{NAN_PARAM}"},
                     nnodes=1, nproc=2):
        assert r.returncode == 0, r.stdout[-3000:]
    col.wait()
    return report_json(col.db)[1]["findings"]


def test_a_nan_gradient_is_a_nan_finding_naming_the_parameter(two_replicas):
    """The first NaN is named by its rank, parameter and step; what follows from it (the
    parameter after the update, the next step's buckets) is its consequence."""
    nan = [f for f in two_replicas if f["kind"] == "nan_inf"]
    assert nan[0]["group"] == f"grad:{NAN_PARAM}[0,1]" and nan[0]["culprits"] == [0]
    assert nan[0]["step"] == 6
    assert all(f["culprits"] == [0] and f["step"] >= 6 for f in nan), nan


def test_two_replicas_cannot_outvote_each_other(two_replicas):
    """With two replicas the vote is a tie: one ambiguous finding lists both sides."""
    grads = [f for f in two_replicas if f["kind"] == "grad_divergence"]
    assert len(grads) == 1
    assert grads[0]["group"] == f"grad:{PARAM}[0,1]" and grads[0]["step"] == 3
    assert grads[0]["ambiguous"] and grads[0]["culprits"] == [0, 1]
    assert [s["ranks"] for s in grads[0]["detail"]["sides"]] == [[0], [1]]
