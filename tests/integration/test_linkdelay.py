"""A slow link between simulated nodes is named as that node's links, not as a rank
(docs/stragglers.md, "A slow link in a test").

Three network namespaces are three nodes, one gloo rank each, joined by veths to a bridge in
a fourth (the switch, where the collector listens); the addresses live only inside those
namespaces, so nothing leaves the machine. The job (``workers/linkpairs.py``) exchanges
tensors between every two nodes in 2-rank groups, all of a rank's at once. At step
``SLOW_AT`` node2's rank puts an ``htb`` rate limit on its own veth (this kernel has no
``netem`` to delay packets; a rate limit is a NIC renegotiated to a lower speed): every
exchange touching node2 takes ~30-60 ms instead of ~2 ms, and node0's and node1's ranks
come late to their own exchange after waiting for theirs with node2. One job serves both
cases: the steps before the onset are the clean topology (the windows are full and judged
from step 16), the steps after it the slow link. Skipped, with the reason, where
namespaces or the qdisc cannot be made (no root, no ``ip``/``tc``).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ..harness import BIN, WORKERS, _started, commcheck_cmd, report_json
from .test_delivery import wait_for
from .test_netns import cannot_make_namespaces, in_ns, sh

pytestmark = [pytest.mark.integration, pytest.mark.serial]

NODES, STEPS, SLOW_AT = 3, 40, 24
TAG = f"cl{os.getpid() % 100000}"
NS_SW = f"{TAG}sw"
SUBNET = "10.231.78"  # a /24 living only on this bridge
ADDR_SW = f"{SUBNET}.254"
# node2's NIC sends at 4 Mbit/s (16 KiB each way: ~30 ms, not ~1 ms), except to the
# collector: its relay's records reach the collector in time, as over a management network
# (a relay behind the slow link delays the evidence, see docs/stragglers.md)
SLOW_NIC = ("qdisc add dev {dev} root handle 1: htb default 20",
            "class add dev {dev} parent 1: classid 1:10 htb rate 1gbit",
            "class add dev {dev} parent 1: classid 1:20 htb rate 4mbit burst 1600 cburst 1600",
            "filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip dst "
            f"{ADDR_SW}/32 flowid 1:10")
# 2-rank groups of ranks starting up on a 2-core box loaded 7-11x over: one rank of a group
# cost the other 5.8-7.8 % of its time by chance (measured); the slow-rank rule's default
# 5 % (tested in test_stragglers.py) is not what this test is about
NOISE = "cost=0.15"


def ns(node: int) -> str:
    return f"{TAG}n{node}"


def nic(node: int) -> str:
    return f"{TAG}h{node}"


def _cannot() -> str | None:
    """Why this test cannot run here (no root, no ``ip``/``tc``, no bridge, ``htb`` or ``u32``)."""
    bridge = f"{TAG}pb"
    return cannot_make_namespaces(
        ("ip", "tc"),
        (("ip", "link", "add", bridge, "type", "bridge"),
         *(("tc", *cmd.format(dev=bridge).split()) for cmd in SLOW_NIC)),
        "make namespaces and slow a link", "a namespace, a bridge or an htb rate limit")


def _setup() -> None:
    sh("ip", "netns", "add", NS_SW)
    sh(*in_ns(NS_SW, "ip", "link", "set", "lo", "up"))
    sh(*in_ns(NS_SW, "ip", "link", "add", f"{TAG}br", "type", "bridge"))
    sh(*in_ns(NS_SW, "ip", "addr", "add", f"{ADDR_SW}/24", "dev", f"{TAG}br"))
    sh(*in_ns(NS_SW, "ip", "link", "set", f"{TAG}br", "up"))
    for node in range(NODES):
        port = f"{TAG}p{node}"
        sh("ip", "netns", "add", ns(node))
        sh("ip", "link", "add", nic(node), "netns", ns(node), "type", "veth", "peer", "name",
           port, "netns", NS_SW)
        sh(*in_ns(NS_SW, "ip", "link", "set", port, "master", f"{TAG}br"))
        sh(*in_ns(NS_SW, "ip", "link", "set", port, "up"))
        sh(*in_ns(ns(node), "ip", "link", "set", "lo", "up"))
        sh(*in_ns(ns(node), "ip", "addr", "add", f"{SUBNET}.{node + 1}/24", "dev", nic(node)))
        sh(*in_ns(ns(node), "ip", "link", "set", nic(node), "up"))


def _teardown() -> None:
    for name in (NS_SW, *map(ns, range(NODES))):  # a namespace takes its veth ends along
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def slowed_link(tmp_path_factory):
    """The job run to its end: (its report, the onset's wall time, seconds it took)."""
    reason = _cannot()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("linkdelay")
    db, ready = tmp / "run.db", tmp / "ready"
    began = time.monotonic()
    try:
        _setup()
        col = subprocess.Popen(
            in_ns(NS_SW, *commcheck_cmd("collect", "--bind", f"tcp://{ADDR_SW}:5555",
                                        "--world-size", str(NODES), "--db", str(db),
                                        "--ready-file", str(ready), "--no-live",
                                        "--exit-when-done", "--straggler", NOISE)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)
        _started.append(col)
        wait_for(ready.exists, 30, "the collector")
        env = {**os.environ, "COMMCHECK_COLLECTOR": f"tcp://{ADDR_SW}:5555",
               "PAIRS_STEPS": str(STEPS), "PAIRS_SLOW_AT": str(SLOW_AT),
               "PAIRS_SLOW_RANK": str(NODES - 1), "PAIRS_MARK": str(tmp),
               "PAIRS_SLOW_CMD": " && ".join(f"tc {c.format(dev=nic(NODES - 1))}"
                                             for c in SLOW_NIC),
               "PYTHONUNBUFFERED": "1"}
        jobs = []
        for node in range(NODES):
            jobs.append(subprocess.Popen(
                in_ns(ns(node), str(BIN / "torchrun"), f"--nnodes={NODES}",
                      f"--node-rank={node}", "--nproc-per-node=1",
                      f"--master-addr={SUBNET}.1", "--master-port=29540",
                      str(WORKERS / "linkpairs.py")),
                env={**env, "COMMCHECK_HOST": f"node{node}", "GLOO_SOCKET_IFNAME": nic(node)},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
            _started.append(jobs[-1])
        for job in jobs:
            out, _ = job.communicate(timeout=150)
            assert job.returncode == 0, out[-3000:]
        ran = time.monotonic() - began
        _, err = col.communicate(timeout=60)
        assert col.returncode == 1, err  # 1: a finding, the slow link
    finally:
        _teardown()
    onset = float((tmp / "onset").read_text())
    return report_json(db)[1], onset, (ran, time.monotonic() - began)


@pytest.mark.timeout(180)
def test_a_slow_nodes_link_is_named_not_a_rank(slowed_link):
    report, onset, took = slowed_link
    print(f"job {took[0]:.1f} s, with the report {took[1]:.1f} s; {report['findings']}")
    [f] = report["findings"]  # no rank: its members entered together
    d = f["detail"]
    assert (f["kind"], d["cause"], f["culprits"], d["rank"]) == ("straggler", "link", [], None)
    assert d["link"] == ["node2"] and f["hosts"] == ["node2"], d  # node2's links, not a pair
    assert d["ranks"] == [0, 1, 2]
    assert f["t"] >= onset  # nothing before it: the clean topology
    # on a box loaded 10x over, node2's rank starved of CPU before the onset makes its
    # exchanges slow too (seen: 10-25 ms against 2 ms): the change point may come earlier
    assert SLOW_AT - 10 <= d["start_step"] <= SLOW_AT + 8 and f["step"] == d["start_step"]
    assert d["median_gap_ms"] >= 4 * d["baseline_ms"] and d["median_gap_ms"] > 20, d
