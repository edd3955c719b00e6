"""A ``(*args, **kwargs)`` monkeypatch installed before ``patch()`` hides nothing: calls are
bound by torch's own signature (the OpSpec's parameters) whatever object the name held, so
a job with faults under such a shim finds every fault (torchrun, gloo, 4 ranks)."""

from __future__ import annotations

import pytest

from ..harness import WORKERS, report_json, run_job, start_collector

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
FAULTS = WORKERS / "faults.py"
INJECT = "bitflip:rank=2,op=all_reduce,call=3;bitflip:rank=1,op=all_gather,call=5"


@pytest.mark.parametrize("where", ["dist", "both"])
def test_faults_under_a_plain_shim_are_all_found(tmp_path, where):
    col = start_collector(tmp_path, 4, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_INJECT": INJECT,
           "FAULT_SHIM": where}
    for r in run_job(FAULTS, env):
        assert r.returncode == 0, r.stdout[-2000:]
    col.wait()
    rc, rep = report_json(col.db)
    found = {(f["op"], f["seq"]) for f in rep["findings"]}
    assert found == {("all_reduce", 4), ("all_gather", 9)}, rep["findings"]
    assert "no findings" not in str(rep.get("summary", ""))
