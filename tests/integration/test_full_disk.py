"""The collector's database. A full disk stops the collector with one line and loses
nothing: what it had not committed it had not acknowledged, and a collector restarted on
the same database takes the senders' resends (docs/usage.md, "When the collector's disk is
full"). A second collector on a database in use is refused."""

from __future__ import annotations

import resource
import subprocess
import time

import pytest
import zmq

from commcheck.collector.bench import Plan, build, expected_records

from ..harness import commcheck_cmd, start_collector
from ..senders import counters

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIMIT = 2_500_000  # bytes any one file of the first collector may reach (a new database
# of 64 KiB pages and its write-ahead log take ~1.5 MB)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _send(endpoint: str, msgs: list[bytes]) -> None:
    """Every message, as relays resend what was never acknowledged (acks not read)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        for m in msgs:
            sock.send(m)
    finally:
        sock.close(linger=3000)
        ctx.term()


@pytest.mark.parametrize("records", ["file", "rows"])
def test_a_full_disk_stops_the_collector_with_one_line_and_a_restart_loses_nothing(
        tmp_path, records):
    plan = Plan(ranks=8, records=60_000, t0=time.time() + 3600)
    msgs = build(plan, list(range(plan.ranks)))
    db = tmp_path / "run.db"
    ready = tmp_path / "first.ready"
    first = subprocess.Popen(
        commcheck_cmd("collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "8",
                      "--db", str(db), "--ready-file", str(ready), "--no-live",
                      "--records", records, "--idle-timeout", "20"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        preexec_fn=_limited)
    deadline = time.monotonic() + 30
    while not ready.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), first.communicate(timeout=30)
    _send(ready.read_text().strip(), msgs)
    _, err = first.communicate(timeout=60)

    assert first.returncode == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"commcheck: error: {db}: cannot write (") and \
        "stopped without acknowledging what came after the last commit" in last, err
    assert counters(db).get("records", 0) < expected_records(plan)  # it did stop short

    again = start_collector(tmp_path, 8, "--records", records, "--exit-when-done", db=db)
    _send(again.endpoint, msgs)
    code, out, err = again.wait(60)
    assert code == 0, err
    c = counters(db)
    assert c["records"] == expected_records(plan) and c["findings"] == 0
    assert c["verified"] == plan.calls  # every collective once (8 ranks: the world group)
    if records == "file":  # the same database analysed into a disk that fills up
        out = tmp_path / "analysis.db"
        p = subprocess.run(commcheck_cmd("analyze", str(db), "--db", str(out)),
                           capture_output=True, text=True, timeout=60, preexec_fn=_limited)
        assert p.returncode == 2 and p.stderr.splitlines()[-1].startswith(
            f"commcheck: error: {out}: cannot write ("), p.stderr
        assert "Traceback" not in p.stderr and not out.exists()  # no half-written database


def test_a_second_collector_on_a_database_in_use_is_refused(tmp_path):
    """Two writers would interleave commits, snapshots and delivery rows; readers still
    read it meanwhile."""
    first = start_collector(tmp_path, 2, "--idle-timeout", "30")
    p = subprocess.run(commcheck_cmd("collect", "--bind", "tcp://127.0.0.1:*", "--world-size",
                                     "2", "--db", str(first.db), "--no-live"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.splitlines()[-1] == (
        f"commcheck: error: {first.db}: another commcheck collect (or analyze) is writing "
        f"it; stop that one first, or use another --db"), p.stderr
    report = subprocess.run(commcheck_cmd("report", str(first.db), "--json"),
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 3 and '"records": 0' in report.stdout  # read while it runs
    code, _, err = first.terminate()
    assert code == 3, err  # the first one went on, and ends as an empty run does
