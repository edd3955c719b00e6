"""Every covered op end to end: torchrun (gloo, 2 simulated nodes x 2 ranks) running
tests/workers/coverage.py against a real collector, once, with a corrupted p2p message,
all_to_all chunks and one DDP bucket: four of its calls, each one finding; every other call
is the clean case (no finding, every record, every group)."""

from __future__ import annotations

import subprocess

import pytest

from ..harness import WORKERS, call_lines, commcheck_cmd, report_json, run_job, start_collector
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

COVERAGE = WORKERS / "coverage.py"
LINES = call_lines(COVERAGE)

# Complete records per op, all ranks together (ITERS = 2 in the worker; 4 ranks).
EXPECTED = {
    "reduce": 16, "gather": 8 + 4, "scatter": 8 + 8 + 4, "all_to_all": 8,
    "all_to_all_single": 24, "reduce_scatter": 8,
    "all_gather_coalesced": 8, "barrier": 8 + 4, "monitored_barrier": 8,
    # c10d 32 (2 coalescing blocks x 2) + groups 3 + 4 + 4 + funcol 4 + reference 4
    "all_reduce": 51,
    # c10d 8 + mesh 4 + funcol 4 + DTensor 4 + FSDP2 32
    "all_gather_single": 52, "reduce_scatter_single": 8 + 4 + 16,
    # objects: all_gather_object 2 x 4 + subgroups 4
    "all_gather": 12 + 4, "broadcast": 12 + 4,
    # per iteration: ring 4, sync pairs 2, any-source 1, two batch rings 8; objects 2
    "send": 15 * 2 + 2, "recv": 15 * 2 + 2,
    "all_reduce_coalesced": 16 + 4, "all_gather_single_coalesced": 4,  # c10d + funcol
    "ddp_allreduce": 20,  # 1 bucket in step 1, 2 after DDP rebuilt them, x 4 ranks
}

FAULTS = ("p2p:rank=1,op=recv,call=3;chunk:rank=2,op=all_to_all,call=2,chunk=0;"
          "chunk:rank=3,op=all_to_all_single,call=2;bitflip:rank=1,op=ddp_allreduce,call=4")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """The job with FAULTS: (collector status, report document, database)."""
    tmp = tmp_path_factory.mktemp("coverage")
    col = start_collector(tmp, 4, "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": tmp.name,
           "COMMCHECK_INJECT": FAULTS}
    for r in run_job(COVERAGE, env):
        assert r.returncode == 0, r.stdout[-4000:]
    rc, out, err = col.wait()
    code, doc = report_json(col.db)
    return rc, doc, col.db


def _at(f: dict) -> str:
    return f["callsite"].split(" ")[0].rsplit(":", 1)[1]


def test_the_clean_part_of_every_op_has_no_findings(faulty):
    rc, doc, db = faulty
    brief = [(f["kind"], f["op"], f["group"], f["culprits"]) for f in doc["findings"]]
    assert len(doc["findings"]) == 4, brief  # the faults' (next test), nothing else
    assert rc == 1
    s = doc["summary"]
    assert s["unmatched"] == 0 and s["dropped_on_ranks"] == 0
    assert s["not_checked_on_ranks"] == 0
    # DDP's constructor and first bucket rebuild talk in C++ (parameter-shape check, state
    # broadcast, bucket-order sync): counted as bypassed, everything else was seen
    assert s["bypassed"] == {"0": 5}, s["bypassed"]
    text = subprocess.run(commcheck_cmd("report", str(db)), capture_output=True, text=True,
                          timeout=60).stdout
    assert "5 collectives bypassed commcheck and were not checked (group 0: 5)" in text
    with stored(db) as conn:
        done = "t_done > 0"  # entry records carry no completion time
        counts = dict(conn.execute(f"SELECT op, COUNT(*) FROM records WHERE {done} "
                                   "GROUP BY op"))
        groups = {g: set(map(int, r.split(","))) for g, r in conn.execute(
            f"SELECT grp, GROUP_CONCAT(DISTINCT rank) FROM records WHERE {done} GROUP BY grp")}
        entries = conn.execute("SELECT COUNT(*) FROM records WHERE t_done = 0").fetchone()[0]
        by_line = {(op, int(line)) for op, line in conn.execute(
            "SELECT op, SUBSTR(callsite, INSTR(callsite, 'coverage.py:') + 12, 3) "
            f"FROM records WHERE {done}")}
    assert counts == EXPECTED
    # every complete record has its entry record, except any-source receives (keyed late)
    assert entries == sum(EXPECTED.values()) - 2
    assert groups["1[0,1,3]"] == {0, 1, 3}  # rank 2 is outside the subgroup
    assert sorted(len(r) for g, r in groups.items() if not g.startswith(("0[", "p2p"))) == \
        [2] * 6 + [3]  # new_subgroups(2) x 2, 2x2 DeviceMesh dims x 2, new_group
    assert {g for g in groups if g.startswith("p2p")} == {
        "p2p:0->1[0,1]", "p2p:1->2[1,2]", "p2p:2->3[2,3]", "p2p:3->0[0,3]", "p2p:0->3[0,3]"}
    for op, marker in [("all_reduce", "fc_ar"), ("all_gather_single", "fc_ag"),
                       ("reduce_scatter_single", "fc_rs"), ("scatter", "dt_dist"),
                       ("all_gather_single", "dt_ag"), ("all_gather_single", "fsdp"),
                       ("reduce_scatter_single", "fsdp"), ("ddp_allreduce", "ddp"),
                       ("recv", "recv_any"), ("send", "batch"), ("all_reduce", "mesh_dp"),
                       ("all_gather", "ago"), ("send", "sendobj"),
                       ("all_reduce_coalesced", "fc_arc"),
                       ("all_gather_single_coalesced", "fc_agc")]:
        assert (op, LINES[marker]) in by_line, (op, marker)


def test_corrupted_p2p_chunks_and_bucket_name_their_links_and_rank(faulty):
    rc, doc, _ = faulty
    assert rc == 1
    found = {(f["kind"], _at(f)): f for f in doc["findings"]}
    brief = [(f["kind"], f["op"], f["group"], f["culprits"]) for f in doc["findings"]]
    assert len(doc["findings"]) == 4, brief
    p2p = found[("link_corruption", str(LINES["batch"]))]  # rank 1's 3rd receive
    assert p2p["group"] == "p2p:0->1[0,1]" and p2p["culprits"] == [1]
    assert p2p["op"] == "recv"  # the side that received bad data, not the lower rank's send
    assert p2p["detail"]["links"] == [[0, 1]] and p2p["detail"]["injected"] is True
    a2a = found[("link_corruption", str(LINES["a2a"]))]
    assert a2a["culprits"] == [2] and a2a["detail"]["links"] == [[0, 2]]
    a2as = found[("link_corruption", str(LINES["a2as_split"]))]
    assert a2as["culprits"] == [3] and a2as["detail"]["links"] == [[0, 3]]
    ddp = found[("value_mismatch", str(LINES["ddp"]))]
    assert ddp["op"] == "ddp_allreduce" and ddp["culprits"] == [1]
    assert ddp["hosts"] == ["node0"]
