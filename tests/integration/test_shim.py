"""A ``(*args, **kwargs)`` monkeypatch installed before ``patch()`` hides nothing: calls are
bound by torch's own signature (the OpSpec's parameters) whatever object the name held, so
a job with faults under such a shim finds every fault (torchrun, gloo, 4 ranks)."""

from __future__ import annotations

import pytest

from ..harness import WORKERS, report_json, run_job, start_collector

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
FAULTS = WORKERS / "faults.py"
# each node its own shim (tests/workers/faults.py), each shim both ops with a fault on it
SHIMS = {"node0": "dist", "node1": "both"}
INJECT = ("bitflip:rank=2,op=all_reduce,call=3;bitflip:rank=1,op=all_gather,call=5;"
          "bitflip:rank=0,op=all_reduce,call=6;bitflip:rank=3,op=all_gather,call=7")


def test_faults_under_a_plain_shim_are_all_found(tmp_path):
    """Node 0's ranks shim ``torch.distributed`` only, node 1's also ``distributed_c10d``:
    one job, every fault found on its rank, nothing else."""
    col = start_collector(tmp_path, 4, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_INJECT": INJECT,
           "FAULT_SHIM": ",".join(SHIMS.values())}
    for r in run_job(FAULTS, env):
        assert r.returncode == 0, r.stdout[-2000:]
    col.wait()
    rc, rep = report_json(col.db)
    found = {(f["op"], f["seq"], tuple(f["culprits"]), tuple(f["hosts"]))
             for f in rep["findings"]}
    assert found == {("all_reduce", 4, (2,), ("node1",)), ("all_gather", 9, (1,), ("node0",)),
                     ("all_reduce", 10, (0,), ("node0",)),
                     ("all_gather", 13, (3,), ("node1",))}, rep["findings"]
    assert len(rep["findings"]) == 4
