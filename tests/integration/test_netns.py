"""A network fault between two simulated hosts: the link to the collector is cut for 10 s
mid-run and healed. Nothing may be lost and no training step may block.

The test makes two network namespaces (the collector's host and the ranks' host) joined by
a veth pair with addresses from a private /30 that exist only inside those namespaces, so
no packet can leave the machine. The collector runs in one, a torchrun job (gloo over the
namespace's own loopback) in the other; the cut is ``ip link set ... down`` on the ranks'
end. Skipped, with the reason, where namespaces cannot be made (no root, no ``ip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ..harness import BIN, WORKERS, _started, commcheck_cmd, report_json
from ..stored import stored
from .test_delivery import committed_records, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(240)]

STEPS, NPROC = 300, 2
TAG = f"cc{os.getpid() % 100000}"
NS_C, NS_R = f"{TAG}c", f"{TAG}r"  # collector host, ranks host
IF_C, IF_R = f"{TAG}vc", f"{TAG}vr"  # veth ends (names under 16 characters)
ADDR_C, ADDR_R = "10.231.77.1", "10.231.77.2"  # a /30 living only on this veth pair


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


def in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def cannot_make_namespaces(tools: tuple[str, ...] = ("ip",),
                           inside: tuple[tuple[str, ...], ...] = (),
                           purpose: str = "make network namespaces",
                           what: str = "a network namespace") -> str | None:
    """Why namespaces cannot be made here (None: they can): ``tools`` on the PATH, root, and
    a throw-away namespace in which every command of ``inside`` runs."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2) to {purpose}"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"{TAG}probe"
    try:
        sh("ip", "netns", "add", probe)
        for cmd in inside:
            sh(*in_ns(probe, *cmd))
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot make {what} here: {getattr(e, 'stderr', e)!r}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


def _teardown() -> None:
    for ns in (NS_C, NS_R):  # deleting a namespace deletes its veth end, and the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def _setup() -> None:
    sh("ip", "netns", "add", NS_C)
    sh("ip", "netns", "add", NS_R)
    sh("ip", "link", "add", IF_C, "type", "veth", "peer", "name", IF_R)
    sh("ip", "link", "set", IF_C, "netns", NS_C)
    sh("ip", "link", "set", IF_R, "netns", NS_R)
    for ns, ifname, addr in ((NS_C, IF_C, ADDR_C), (NS_R, IF_R, ADDR_R)):
        sh(*in_ns(ns, "ip", "link", "set", "lo", "up"))
        sh(*in_ns(ns, "ip", "addr", "add", f"{addr}/30", "dev", ifname))
        sh(*in_ns(ns, "ip", "link", "set", ifname, "up"))


def test_link_cut_for_10s_loses_nothing_and_never_blocks_training(tmp_path):
    reason = cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    db, ready, times = tmp_path / "run.db", tmp_path / "ready", tmp_path / "times"
    times.mkdir()
    try:
        _setup()
        col = subprocess.Popen(
            in_ns(NS_C, *commcheck_cmd("collect", "--bind", f"tcp://{ADDR_C}:5555",
                                       "--world-size", str(NPROC), "--db", str(db),
                                       "--ready-file", str(ready), "--no-live",
                                       "--exit-when-done", "--hang-timeout", "600")),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        _started.append(col)
        wait_for(ready.exists, 30, "the collector")
        env = {**os.environ, "COMMCHECK_COLLECTOR": f"tcp://{ADDR_C}:5555",
               "COMMCHECK_RUN_ID": "netns", "COMMCHECK_LINGER": "60",
               "COMMCHECK_ACK_TIMEOUT": "1", "WORKER_STEPS": str(STEPS),
               "WORKER_SLEEP": "0.06", "WORKER_TIMES": str(times), "PYTHONUNBUFFERED": "1"}
        job = subprocess.Popen(
            in_ns(NS_R, str(BIN / "torchrun"), "--nnodes=1", f"--nproc-per-node={NPROC}",
                  "--master-addr=127.0.0.1", "--master-port=29533", str(WORKERS / "steady.py")),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _started.append(job)
        wait_for(lambda: committed_records(db) > 0, 60, "the first records")
        sh(*in_ns(NS_R, "ip", "link", "set", IF_R, "down"))
        at_cut = committed_records(db)
        time.sleep(10)
        during = committed_records(db)
        sh(*in_ns(NS_R, "ip", "link", "set", IF_R, "up"))
        out, _ = job.communicate(timeout=150)
        assert job.returncode == 0, out[-3000:]
        c_out, c_err = col.communicate(timeout=60)
        assert col.returncode == 0, c_err
    finally:
        _teardown()
    total = NPROC * STEPS * 3 * 2  # 3 collectives a step, an entry and a complete record each
    assert 0 < at_cut < total and during - at_cut < total // 10, (at_cut, during)
    with stored(db) as conn:
        n = conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        distinct = conn.execute("SELECT COUNT(*) FROM (SELECT DISTINCT run, rank, grp, seq, "
                                "t_done > 0 FROM records)").fetchone()[0]
    assert n == distinct == total  # nothing lost, nothing twice
    code, doc = report_json(db)
    assert code == 0 and doc["summary"]["ranks_said_goodbye"] == NPROC
    assert doc["summary"]["unmatched"] == 0 and doc["summary"]["dropped_on_ranks"] == 0
    # the cut is in the report, not only in a counter (issue 18)
    (outage,) = doc["summary"]["outages"]
    assert outage["ranks"] == list(range(NPROC)) and outage["dropped"] == 0, outage
    assert 9 <= outage["seconds"] <= 40, outage
    assert "could not reach the collector for" in c_out and "nothing lost" in c_out, c_out
    steps = [float(t) for p in times.iterdir() for t in p.read_text().split()]
    assert len(steps) == NPROC * STEPS
    assert max(steps) < 1.0, f"a step took {max(steps):.2f} s while the link was down"
    print(f"steps: median {sorted(steps)[len(steps) // 2] * 1e3:.2f} ms, "
          f"max {max(steps) * 1e3:.1f} ms; records at cut {at_cut}, after 10 s {during}",
          file=sys.stderr)
