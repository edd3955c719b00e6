"""``commcheck run`` on scripts that never import commcheck: real torchrun, gloo, relay,
collector and SQLite; the report is read back with ``commcheck report --json``.

The clean-DDP case needs DDP to be watched by default (issue 14 item 2, rank/ddp.py): without
that, DDP's gradient all-reduce bypasses the wrappers and nothing is verified.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..harness import ROOT, WORKERS, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PLAIN = WORKERS / "unmodified.py"
DDP = WORKERS / "unmodified_ddp.py"
REPORT_HEAD = "commcheck report:"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra.get("PYTHONPATH")) if p)
    env.pop("COMMCHECK_RUN_ID", None)
    return env


def run(tmp: Path, *args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """``python -m commcheck run ARGS`` in ``tmp``, its database ``tmp/run.db``."""
    cmd = [sys.executable, "-m", "commcheck", "run", "--db", str(tmp / "run.db"),
           "--stop-timeout", "20", *args]
    return subprocess.run(cmd, cwd=tmp, env=_env(**env), text=True, capture_output=True,
                          timeout=timeout)


def report(db: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "commcheck", "report", "--json", str(db)],
                       env=_env(), capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)


def _line(path: Path, marker: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


def test_unmodified_ddp_gradients_are_verified(tmp_path):
    """Needs DDP watched by default (issue 14 item 2): DDP's own bucket all-reduce."""
    r = run(tmp_path, "--nproc-per-node", "4", str(DDP))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (r.stdout + r.stderr).count(REPORT_HEAD) == 1
    summary = report(tmp_path / "run.db")["summary"]
    assert summary["ranks_said_goodbye"] == 4
    assert summary["verified"] > 0
    assert summary["findings"] == 0


def test_unmodified_ddp_bit_flip_in_own_hook_names_rank_step_and_backward_line(tmp_path):
    """The script's own comm hook, registered after the bootstrap patched the rank, is
    wrapped: one flipped bit on rank 2 at step 3 is a finding at the backward() line."""
    r = run(tmp_path, "--nproc-per-node", "4", str(DDP), "--flip", "2:3")
    assert r.returncode == 1, r.stderr[-3000:]
    findings = report(tmp_path / "run.db")["findings"]
    assert findings, r.stdout
    first = findings[0]
    assert first["kind"] == "value_mismatch"
    assert first["culprits"] == [2]
    assert first["step"] == 3
    # shown as the user wrote it: relative to the script's directory
    assert first["callsite"].startswith(f"{DDP.name}:{_line(DDP, '# BACKWARD')} ")
    assert all(f["culprits"] == [2] for f in findings)


def test_module_entry_point_with_an_injected_fault_and_an_existing_sitecustomize(tmp_path):
    """``-m module`` under the bootstrap, its arguments passed on, a fault injected through
    the environment and found; the user's own sitecustomize (on PYTHONPATH behind the
    bootstrap) still runs in every rank, once. One job: the script-path form is the DDP
    tests'."""
    (tmp_path / "trainmod.py").write_text(PLAIN.read_text())
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if 'LOCAL_RANK' in os.environ:\n"
        "    open(os.path.join(os.environ['SITE_MARKS'], os.environ['LOCAL_RANK']), 'a')"
        ".write('x')\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    r = run(tmp_path, "--nproc-per-node", "3", "-m", "trainmod", "--steps", "8",
            PYTHONPATH=str(site), SITE_MARKS=str(marks),
            COMMCHECK_INJECT="bitflip:rank=1,op=all_reduce,call=5,bit=30")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "unmodified: done" in r.stdout
    assert r.stdout.count(REPORT_HEAD) == 1
    assert re.search(r"relay pid \d+ serves this node", r.stderr)  # the ranks found it
    assert "started another" not in r.stderr
    doc = report(tmp_path / "run.db")
    assert [(f["kind"], f["culprits"], f["op"]) for f in doc["findings"]] == \
        [("value_mismatch", [1], "all_reduce")]
    summary = doc["summary"]
    assert summary["verified"] == 8 and summary["ranks_said_goodbye"] == 3  # --steps 8
    assert sorted((p.name, p.read_text()) for p in marks.iterdir()) == \
        [("0", "x"), ("1", "x"), ("2", "x")]


def _one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    lines = r.stderr.strip("\n").splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("commcheck run: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_bad_input_is_one_line(tmp_path):
    """Through the real command (the split itself: tests/unit/test_run_options.py)."""
    _one_error_line(run(tmp_path, "--nproc-per-node", "2", "--no-such-option", str(PLAIN)),
                    "--no-such-option")
    _one_error_line(run(tmp_path, "--nproc-per-node", "2", "missing.py"), "missing.py")
    fake = tmp_path / "notorch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch here')\n")
    _one_error_line(run(tmp_path, str(PLAIN), PYTHONPATH=str(fake.parent)),
                    "torchrun is missing")
    assert not (tmp_path / "run.db").exists()


def test_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _one_error_line(run(tmp_path, "--nproc-per-node", "2", "--collector-port",
                                   str(port), str(PLAIN)), "collector did not start")
        assert re.search(r"address already in use|in use", line, re.I), line


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """One scrape with a plain HTTP client, parsed by prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_scraped_during_a_run_match_the_report(tmp_path):
    """`collect --metrics` scraped over HTTP while `commcheck run --collector` trains 2 ranks
    (one injected fault); once every rank said goodbye the counters equal the report's."""
    import signal
    import time

    from ..harness import start_collector

    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    collector = start_collector(tmp_path, 2, "--metrics", str(port))
    proc = subprocess.Popen(
        [sys.executable, "-m", "commcheck", "run", "--collector", collector.endpoint,
         "--nproc-per-node", "2", str(PLAIN), "--steps", "20", "--sleep", "0.2"],
        cwd=tmp_path, env=_env(COMMCHECK_INJECT="bitflip:rank=1,op=all_reduce,call=5"),
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    during = []
    while proc.poll() is None:
        during.append(_scrape(url))
        time.sleep(0.3)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]  # training succeeded; the report is elsewhere
    assert REPORT_HEAD not in out + err
    assert any(m[("commcheck_records_total", ())] > 0 for m in during)
    assert any(m[("commcheck_ranks", (("state", "connected"),))] == 2 for m in during)
    deadline = time.monotonic() + 30
    while True:
        last = _scrape(url)
        if last[("commcheck_ranks", (("state", "goodbye"),))] == 2 or \
                time.monotonic() > deadline:
            break
        time.sleep(0.3)
    time.sleep(1.0)  # the last batches' commit
    last = _scrape(url)
    collector.proc.send_signal(signal.SIGTERM)
    collector.wait(30)
    s = report(collector.db)["summary"]
    assert last[("commcheck_records_total", ())] == s["records"] > 0
    assert last[("commcheck_collectives_verified_total", ())] == s["verified"] == 20
    findings = {k[1][0][1]: v for k, v in last.items() if k[0] == "commcheck_findings_total"}
    assert findings == s["by_kind"] == {"value_mismatch": 1}
    assert last[("commcheck_ranks", (("state", "goodbye"),))] == s["ranks_said_goodbye"] == 2
    assert last[("commcheck_ranks", (("state", "silent"),))] == 0
    assert last[("commcheck_world_size", ())] == 2
    assert last[("commcheck_rank_records_spilled_total", ())] == s["spilled_on_ranks"]
    assert last[("commcheck_rank_records_dropped_total", ())] == s["dropped_on_ranks"]
    assert not any(k[0] == "commcheck_rejected_messages_total" for k in last)
    assert s["rejected"] == {}
    assert last[("commcheck_ingest_lag_seconds_count", ())] > 0


def test_a_script_that_dies_before_training_ends_the_run_without_waiting(tmp_path):
    """Every rank fails to compile the script, so no rank makes a ring: once torchrun exits
    the relay is told no more ranks will come and ends by itself, and the collector is
    given only a moment more (both waited out the stop timeout for ranks that never
    started); the report says nobody reported."""
    (tmp_path / "bad.py").write_text("import torch\nx = (\n")
    r = run(tmp_path, "--nproc-per-node", "2", "bad.py")
    assert r.returncode != 0
    assert "SyntaxError" in r.stderr
    assert "the relay had not delivered everything" not in r.stderr, r.stderr[-2000:]
    assert "not every rank said goodbye within 2 s; stopping the collector" in r.stderr, \
        r.stderr[-2000:]  # not the stop timeout: the only relay had left, nothing could come
    assert "2 of 2 ranks never said goodbye" in r.stdout, r.stdout[-2000:]


def test_a_script_with_no_distributed_call_says_there_was_nothing_to_check(tmp_path):
    (tmp_path / "plain.py").write_text("print('no process group here')\n")
    r = run(tmp_path, "--nproc-per-node", "2", "plain.py")
    assert r.returncode == 3  # nothing verified: not clean, not a failure of training
    assert "commcheck run: torchrun exited 0 and no rank ever connected: the script made no " \
           "torch.distributed call (no init_process_group), so there was nothing to check" \
           in r.stderr, r.stderr[-2000:]


LOOP = """\
import pathlib, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(100_000):
    dist.all_reduce(torch.ones(64))
    if step == 20 and dist.get_rank() == 0:
        pathlib.Path(sys.argv[1]).touch()
    time.sleep(0.005)
"""


def _training_loop(tmp_path: Path) -> subprocess.Popen:
    """``commcheck run`` of LOOP on 2 ranks in a session of its own (a terminal's foreground
    group, a batch job's processes), returned once training is under way."""
    import time

    (tmp_path / "loop.py").write_text(LOOP)
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, "-m", "commcheck", "run", "--db", str(tmp_path / "run.db"),
         "--nproc-per-node", "2", "loop.py", str(started)],
        cwd=tmp_path, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), proc.communicate(timeout=30)
    return proc


def test_ctrl_c_stops_the_run_with_one_report_and_no_false_finding(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the whole foreground group: commcheck run, its
    collector and relay, torchrun, the ranks) mid-training: the ranks stop inside or
    between all_reduces; one report, which says training was interrupted, with no hang or
    missing rank for the call they were stopped around; the status is torchrun's."""
    import signal
    import time

    proc = _training_loop(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 20, err[-3000:]
    assert proc.returncode not in (0, 3), err[-3000:]  # training did not end normally
    assert out.count(REPORT_HEAD) == 1, out[-3000:]
    assert "training failed on ranks 0,1: KeyboardInterrupt (SIGINT)" in out, out[-3000:]
    s = report(tmp_path / "run.db")
    assert s["findings"] == [], s["findings"]
    assert s["summary"]["verified"] > 20 and s["summary"]["unmatched"] <= 1


def test_a_cancelled_job_blames_no_rank(tmp_path):
    """scancel or a time limit: SIGTERM to every process of the job at once (commcheck run,
    its collector and relay, torchrun, the ranks, which die without a goodbye). The run did
    not finish (status 3), and the report says the ranks were stopped together: no
    rank_died for each of them, no hang or missing rank for the call they were stopped in."""
    import signal

    proc = _training_loop(tmp_path)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err[-3000:]
    s = report(tmp_path / "run.db")
    assert s["findings"] == [], s["findings"]
    assert s["summary"]["stopped"] == [{"ranks": [0, 1], "signal": 15}], s["summary"]
    assert s["summary"]["verified"] > 5
    text = subprocess.run([sys.executable, "-m", "commcheck", "report", str(tmp_path / "run.db")],
                          env=_env(), capture_output=True, text=True)
    assert text.returncode == 3, text.stderr
    assert "stopped together by SIGTERM: ranks 0,1 (a cancel or a time limit" in text.stdout
