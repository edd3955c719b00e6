"""``commcheck run`` on a shared node (issue 26 items 2 and 6).

* Another local user who sees the job's run id and collector port (in ``ps``) sends forged
  hellos, records and goodbyes for both ranks: refused at the handshake (the run's CURVE
  keys are in the launcher's private directory), counted and named in the report; the
  job's own records are all acknowledged and verified, the exit status is a clean run's.
* A second ``commcheck run`` into a database that holds an earlier run is refused with one
  line before torchrun starts, instead of printing the earlier run's report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ..harness import ROOT, WORKERS, report_json, start_collector
from ..senders import Push, Rank, wait_counters
from ..users import two_users

pytestmark = pytest.mark.integration

# What the intruder runs: find the victim job's relay in /proc (as `ps` would: the relay
# whose parent is the `commcheck run` writing TARGET), try the launcher's key directory
# (the relay's --ready-file is in it), send forged hellos, records and goodbyes for ranks 0
# and 1 with the job's run id, say what it found, and keep its sockets reconnecting until
# stdin closes.
INTRUDER = r"""
import glob, json, os, sys, time
import zmq
from tests.senders import Push, Rank

def argv_of(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")

def relay():
    for d in glob.glob("/proc/[0-9]*"):
        try:
            argv = argv_of(d.rsplit("/", 1)[1])
            if "commcheck.relay" not in argv or "--run" not in argv:
                continue
            with open(d + "/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            if os.environ["TARGET"] not in argv_of(ppid):  # the victim's `commcheck run`
                continue
        except (OSError, IndexError):
            continue
        return (argv[argv.index("--run") + 1], argv[argv.index("--collector") + 1],
                os.path.dirname(argv[argv.index("--ready-file") + 1]))

deadline = time.monotonic() + 120
while (found := relay()) is None and time.monotonic() < deadline:
    time.sleep(0.05)
run, endpoint, launcher_dir = found
try:
    open(os.path.join(launcher_dir, "keys", "client.key_secret")).read()
    keys = "read"
except OSError as e:
    keys = e.strerror
pushes = [Push(endpoint) for _ in range(2)]
for rank, push in enumerate(pushes):
    forged = Rank(run, rank, world=2)
    for payload in (forged.hello(), forged.batch(5), forged.goodbye()):
        try:
            push.send(payload)
        except zmq.Again:  # no peer to queue for once the handshake was refused (under load)
            break
print(json.dumps({"run": run, "endpoint": endpoint, "dir": launcher_dir, "keys": keys}),
      flush=True)
sys.stdin.read()
for push in pushes:
    push.close(linger_ms=0)
"""


@pytest.mark.timeout(300)
def test_another_user_cannot_speak_for_a_commcheck_run_job():
    job, intruder = two_users()
    work = job.home / f"attack-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    job.chown(work, 0o700)
    steps, db = 8, work / "run.db"
    spy = None
    try:
        run = job.popen([sys.executable, "-m", "commcheck", "run", "--db", str(db),
                         "--stop-timeout", "30", "--nproc-per-node", "2",
                         str(WORKERS / "unmodified.py"), "--steps", str(steps),
                         "--hold", str(work / "go")],
                        env=job.env(PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1"), cwd=work)
        spy = intruder.popen([sys.executable, "-c", INTRUDER], stdin=subprocess.PIPE,
                             env=intruder.env(TARGET=str(db)), cwd=intruder.home)
        seen = json.loads(spy.stdout.readline() or "{}")
        assert seen.get("run"), spy.communicate(timeout=30)
        # the ranks wait halfway until the forged senders were refused (twice: both)
        wait_counters(db, lambda c: c.get("rejected.auth_handshake", 0) >= 2, timeout=120)
        (work / "go").touch()
        out, err = run.communicate(timeout=240)
    finally:
        if spy is not None:
            spy.communicate(timeout=30)
    try:
        assert run.returncode == 0, err[-3000:]
        assert "did not acknowledge" not in err and "Traceback" not in err, err[-3000:]
        # the intruder saw the launcher's key directory and could not read a key from it;
        # the directory is gone with the run
        assert seen["keys"] == "Permission denied", seen
        assert seen["dir"].startswith("/tmp/commcheck-run-") and not os.path.exists(seen["dir"])
        code, doc = report_json(db)
        s = doc["summary"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert code == 0 and doc["findings"] == []
    assert s["runs"] == [seen["run"]] and s["ranks_said_goodbye"] == 2
    assert s["verified"] == steps and s["records"] == 2 * 2 * steps  # entry + completion
    assert "unfinished" not in s and "open_collector" not in s
    assert set(s["rejected"]) == {"auth_handshake"}
    named = s["refused"]  # most refused first; an attempt whose connection was gone
    # before the collector looked up its peer is "an unknown address" (gate.py)
    assert named[0]["who"] == "127.0.0.1 (the sender has no CURVE keys)", named
    assert all(r["reason"] == "auth_handshake" and r["who"].startswith(
        ("127.0.0.1 (", "an unknown address (")) for r in named), named
    assert sum(r["count"] for r in named) == s["rejected"]["auth_handshake"]
    assert "refused 127.0.0.1 (" in out and "no findings" in out, out[-2000:]


@pytest.mark.timeout(120)
def test_a_second_run_into_a_used_database_is_refused_before_training(tmp_path):
    db = tmp_path / "run.db"
    col = start_collector(tmp_path, 1, "--exit-when-done", db=db)
    earlier = Rank("earlier")
    with Push(col.endpoint) as p:
        for payload in (earlier.hello(), earlier.batch(3), earlier.goodbye()):
            p.send(payload)
    assert col.wait(60)[0] == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env.pop("COMMCHECK_RUN_ID", None)
    r = subprocess.run([sys.executable, "-m", "commcheck", "run", "--db", str(db),
                        "--nproc-per-node", "2", str(WORKERS / "unmodified.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 2 and r.stdout == "", r.stdout[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("commcheck run: error:"), line
    assert f"{db} already holds run earlier" in line and "new --db" in line, line
    code, doc = report_json(db)  # the earlier run's database, untouched
    assert doc["summary"]["runs"] == ["earlier"] and doc["summary"]["records"] == 3
