"""End to end with real parts: torchrun (gloo, 2 simulated nodes x 2 ranks), a collector
subprocess on a loopback port, a real SQLite file, and the report CLI."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections import Counter

import pytest

from commcheck.cli import main

from .. import traces
from ..harness import WORKERS, call_lines, commcheck_cmd, report_json, run_job, start_collector
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MIXED = WORKERS / "mixed.py"
LINES = call_lines(MIXED)

# (fault spec, kind, op, culprit, call marker, extra check)
FAULTS = [
    ("bitflip:rank=2,op=all_reduce,call=16,bit=3", "value_mismatch", "all_reduce", 2, "ar_f32"),
    ("bitflip:rank=0,op=all_reduce,call=32,bit=0", "value_mismatch", "all_reduce", 0, "ar_bf16"),
    ("bitflip:rank=3,op=all_reduce,call=47", "value_mismatch", "all_reduce", 3, "ar_async"),
    ("bitflip:rank=1,op=all_gather,call=4,chunk=2", "link_corruption", "all_gather", 1, "ag"),
    ("swap:rank=3,op=all_gather_single,call=28", "link_corruption", "all_gather_single", 3,
     "ags"),
    ("bitflip:rank=1,op=broadcast,call=12", "link_corruption", "broadcast", 1, "bc"),
    ("bitflip:rank=2,op=reduce_scatter_single,call=14,bit=30", "reduction_error",
     "reduce_scatter_single", 2, "rs"),
    ("bitflip:rank=3,op=all_reduce,call=96", "value_mismatch", "all_reduce", 3, "sub_ar"),
    ("bitflip:rank=0,op=all_gather_single,call=54", "link_corruption", "all_gather_single", 0,
     "ag_async"),
]


def _run(tmp_path, inject: str = ""):
    # No straggler analysis: four ranks on two cores under the suite's load take turns being
    # late, which it rightly reports (once, in a fresh clone's run: rank 1 0.6 ms behind for
    # ten steps, 10.7 % of the others' wall), and this job counts divergences exactly.
    # test_stragglers holds that analysis to clean and slowed jobs of its own.
    col = start_collector(tmp_path, 4, "--exit-when-done", "--straggler", "off")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": tmp_path.name}
    if inject:
        env["COMMCHECK_INJECT"] = inject
    results = run_job(MIXED, env)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    rc, out, err = col.wait()
    return rc, out, err, col.db


def test_the_clean_part_of_the_mixed_run_has_no_findings(mixed_faults_live):
    """The faults job is the clean case too: its nine faulty calls are nine of its 240
    collectives (each fault's one finding: the next test); every other call, every op and
    group of the worker, must give nothing, and every record must arrive."""
    rc, out, err, db = mixed_faults_live
    assert rc == 1, err
    code, doc = report_json(db)
    assert code == 1
    assert len(doc["findings"]) == len(FAULTS), [(f["kind"], f["op"], f["culprits"])
                                                for f in doc["findings"]]
    s = doc["summary"]
    # 20 iterations x 11 world-group collectives + 20 subgroup all_reduces.
    assert s["verified"] == 240
    # an entry and a complete record per call; rank 2 is outside the subgroup: none for it
    assert s["records"] == 2 * 940
    assert s["ranks"] == 4 and s["ranks_said_goodbye"] == 4
    assert s["unmatched"] == 0 and s["dropped_on_ranks"] == 0
    with stored(db) as conn:
        hosts = dict(conn.execute("SELECT rank, host FROM ranks"))
        algos = {a for (a,) in conn.execute("SELECT DISTINCT algo FROM records "
                                            "WHERE t_done > 0")}
        aliases = conn.execute("SELECT COUNT(*) FROM records WHERE op='all_gather_into_tensor'"
                               ).fetchone()[0]
        n_gather_single = conn.execute(
            "SELECT COUNT(*) FROM records WHERE op='all_gather_single' AND t_done > 0"
        ).fetchone()[0]
        flags = {f for (f,) in conn.execute("SELECT DISTINCT flags & 1 FROM records "
                                            "WHERE callsite LIKE '%mixed.py:%'")}
    assert hosts == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    assert algos == {"xxh3-128"}
    assert aliases == 0
    assert n_gather_single == 4 * 20 * 3  # plain + alias + async: one record per user call
    assert flags == {0, 1}  # sync and async records both present


def test_each_injected_fault_yields_exactly_one_finding(mixed_faults_live, tmp_path):
    rc, out, err, db = mixed_faults_live
    assert rc == 1, err
    code, doc = report_json(db)
    assert code == 1
    findings = doc["findings"]
    assert len(findings) == len(FAULTS), [(f["kind"], f["op"], f["culprits"]) for f in findings]
    for spec, kind, op, culprit, marker in FAULTS:
        match = [f for f in findings if f["kind"] == kind and f["op"] == op
                 and f["callsite"].split(" ")[0].endswith(f"mixed.py:{LINES[marker]}")]
        assert len(match) == 1, (spec, findings)
        f = match[0]
        assert f["culprits"] == [culprit], (spec, f)
        assert f["hosts"] == [f"node{culprit // 2}"]
        assert f["detail"].get("injected") is True
    by_marker = {f["callsite"].split(" ")[0].rsplit(":", 1)[1]: f for f in findings}
    ag = by_marker[str(LINES["ag"])]
    assert ag["detail"]["links"] == [[2, 1]]
    swapped = by_marker[str(LINES["ags"])]
    assert swapped["detail"]["links"] == [[0, 3], [1, 3]]
    assert by_marker[str(LINES["bc"])]["detail"]["links"] == [[3, 1]]  # root 11 % 4 → rank 1
    sub = by_marker[str(LINES["sub_ar"])]
    assert sub["group"].endswith("[0,1,3]")
    assert by_marker[str(LINES["ar_f32"])]["step"] == 3
    assert doc["summary"]["first_divergence"]["step"] == 3
    assert "suspect host" not in out  # culprits span both nodes
    _trace_matches(db, doc, tmp_path)


def _trace_matches(db, doc: dict, tmp_path) -> None:
    """The run's trace (docs/views.md): well nested with sync and async calls, a track per
    rank under its host, a slice per recorded call, each finding on its culprit's track."""
    out = tmp_path / "run.json"
    assert main(["trace", str(db), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    traces.well_formed(events)
    procs, threads = traces.tracks(events)
    assert {name: procs[pid] for (pid, _), name in threads.items()} == \
        {f"rank {r}": f"node{r // 2}" for r in range(4)}
    assert Counter(e["name"] for e in traces.by(events, "X")) == \
        {o["op"]: o["recorded"] for o in doc["summary"]["ops"]}
    assert not traces.by(events, "B")
    marks = Counter((traces.rank(e), procs[e["pid"]], e["name"].split(":")[0])
                    for e in traces.by(events, "i"))
    assert marks == Counter((f["culprits"][0], f["hosts"][0], f["kind"])
                            for f in doc["findings"])


def test_collector_without_ranks_stops_cleanly_on_sigterm(tmp_path):
    col = start_collector(tmp_path, 4)
    rc, out, err = col.terminate()
    assert rc == 3, err  # nothing recorded: never clean
    assert "SIGTERM" in err
    assert "empty database: no rank ever connected" in out
    with sqlite3.connect(col.db) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key='magic'").fetchone() == (
            "commcheck",)
    r = subprocess.run(commcheck_cmd("report", str(col.db)), capture_output=True, text=True)
    assert r.returncode == 3
    assert "empty database: no rank ever connected" in r.stdout
