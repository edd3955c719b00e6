"""Delivery as a user meets it (issue 18): two simulated nodes of real gloo ranks, their
relays, a real collector.

* the collector starts only after the ranks' small rings overflowed: records are dropped
  while it is away and not after it answers; the dropped collectives are "not verified",
  no finding blames a rank that finished normally; the outage is in the report;
* a key the collector refuses: one line on the rank's stderr, the peer's address in the
  collector's log, and ``--exit-when-done`` exits after ``--done-wait``;
* a node lost with its relay: ``--exit-when-done`` exits within ``--done-wait``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from commcheck.wire.keys import CLIENT_SECRET, SERVER_PUBLIC, keygen
from commcheck.wire.ring import R_ACKED_SEQ, W_DROPPED, Ring, RingError

from ..harness import WORKERS, commcheck_cmd, free_port, report_json, start_collector, start_job
from .test_delivery import wait_for
from .test_relay import _relay_pids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def ring_words(ring_dir: Path) -> dict[int, tuple[int, int]]:
    """rank -> (records dropped, messages acknowledged) of each ring there now."""
    out = {}
    for path in ring_dir.glob("*.ring"):
        try:
            ring = Ring.open(str(path), writable=False)
        except (OSError, RingError):
            continue
        out[ring.identity.rank] = (ring.word(W_DROPPED), ring.word(R_ACKED_SEQ))
        ring.close()
    return out


def rank_pids(ring_dir: Path, node: int) -> set[int]:
    """The pids of the ranks of ``node`` (torchrun's workers leave its process group)."""
    pids = set()
    for path in ring_dir.glob(f"*-n{node}-r*.ring"):
        try:
            ring = Ring.open(str(path), writable=False)
        except (OSError, RingError):
            continue
        pids.add(ring.identity.pid)
        ring.close()
    return pids


def test_a_late_collector_drops_only_while_away_and_blames_nobody(tmp_path):
    steps, port, rings = 300, free_port(), tmp_path / "rings"
    env = {"COMMCHECK_COLLECTOR": f"tcp://127.0.0.1:{port}", "COMMCHECK_RUN_ID": "late",
           "COMMCHECK_RING_DIR": str(rings), "COMMCHECK_RING_BYTES": "65536",
           "COMMCHECK_LINGER": "30", "WORKER_STEPS": str(steps), "WORKER_SLEEP": "0.05"}
    # (the smallest ring: it holds ~3 s of this job's records, more than an ack takes
    # once the collector is up; a ring smaller than write rate x ack latency drops always)
    procs = start_job(WORKERS / "steady.py", env, nnodes=2, nproc=1)
    started = time.monotonic()
    # the collector comes once both rings overflowed (records are being dropped), no
    # sooner than 10 s after the job started (the case; an outage counts from 5 s)
    # and 2.5 s after the rings overflowed: their ~3 s of records waited before that, so the
    # relays have waited 5 s for an ack (an outage) however long the start-up took
    wait_for(lambda: len(w := ring_words(rings)) == 2 and all(d for d, _ in w.values()),
             90, "both ranks dropping records")
    time.sleep(max(started + 10 - time.monotonic(), 2.5))
    col = start_collector(tmp_path, 2, "--exit-when-done", port=port)
    # from the first acknowledgement on, nothing is dropped any more
    at_ack: dict[int, int] = {}

    def first_acks() -> bool:
        for rank, (dropped, acked) in ring_words(rings).items():
            if acked and rank not in at_ack:
                at_ack[rank] = dropped
        return len(at_ack) == 2

    wait_for(first_acks, 30, "the first acknowledgement on both ranks")
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    rc, out, err = col.wait(60)
    code, doc = report_json(col.db)
    s = doc["summary"]
    # mostly unverified is not clean (issue 29 part 2): the share, in the first line, and
    # status 5 above the limit (10% by default; --max-unverified or its variable moves it)
    share = s["not_verified"] / (s["verified"] + s["not_verified"])
    assert s["unverified_share"] == round(share, 4) and share > 0.1, s
    assert rc == code == 5 and s["findings"] == 0, out + err[-2000:]
    assert out.splitlines()[0] == (
        f"commcheck report: {s['records']} records from 2 ranks, {s['verified']} collectives "
        f"verified, {s['not_verified']} not verified ({share * 100:.3g}% unverified)"), out
    assert (f"too little verified to call it clean: {share * 100:.3g}% of the collectives not "
            f"verified (records dropped; the limit is 10%, --max-unverified)") in out, out
    loose = subprocess.run(commcheck_cmd("report", str(col.db), "--max-unverified", "0.99"),
                           capture_output=True, text=True, timeout=60)
    assert loose.returncode == 0, loose.stdout + loose.stderr
    assert "no findings: every verified collective was consistent" in loose.stdout
    assert s["ranks_said_goodbye"] == 2
    assert s["dropped_on_ranks"] == sum(at_ack.values()) > 0  # none after the first ack
    # every collective is verified, or not verified because a rank dropped its records
    assert s["not_verified"] > 0 and s["verified"] + s["not_verified"] == 3 * steps
    assert f"{s['not_verified']} collectives not verified: records dropped on ranks" in out
    outages = s["outages"]  # one per relay (node): each could not reach it for a while
    assert sorted(r for o in outages for r in o["ranks"]) == [0, 1], outages
    assert all(o["seconds"] >= 1 for o in outages), outages
    assert sum(o["dropped"] for o in outages) == s["dropped_on_ranks"]
    assert "could not reach the collector for" in out and "records dropped" in out


def test_a_refused_key_is_one_line_and_exit_when_done_gives_up(tmp_path):
    good, other = tmp_path / "keys", tmp_path / "other"
    keygen(good)
    keygen(other)
    col = start_collector(tmp_path, 1, "--curve-dir", str(good), "--exit-when-done",
                          "--done-wait", "3")
    client = other / CLIENT_SECRET  # a key the collector does not know
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": "refused",
           "COMMCHECK_RING_DIR": str(tmp_path / "rings"), "COMMCHECK_LINGER": "20",
           "COMMCHECK_CURVE_CLIENT_KEY": str(client),
           "COMMCHECK_CURVE_SERVER_KEY": str(good / SERVER_PUBLIC),
           "WORKER_STEPS": "60", "WORKER_SLEEP": "0.05"}
    t0 = time.monotonic()
    (p,) = start_job(WORKERS / "steady.py", env, nnodes=1, nproc=1)
    out, _ = p.communicate(timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 0, out[-3000:]
    said = [line for line in out.splitlines() if "commcheck" in line and
            "refuses" in line]
    assert len(said) == 1 and str(client) in said[0] and col.endpoint in said[0], out[-3000:]
    assert "did not acknowledge" not in out
    assert took < 60  # the rank did not wait out its 20 s linger for acks that never come
    rc, cout, err = col.wait(60)
    assert "refused client key" in err and "from 127.0.0.1" in err, err[-2000:]
    assert "rank 0 silent for 3 s" in err and rc == 3, err[-2000:]


def test_exit_when_done_gives_up_on_a_node_lost_with_its_relay(tmp_path):
    rings = tmp_path / "rings"
    col = start_collector(tmp_path, 2, "--exit-when-done", "--done-wait", "5")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": "lostnode",
           "COMMCHECK_RING_DIR": str(rings), "WORKER_STEPS": "2000",
           "WORKER_SLEEP": "0.02"}
    procs = start_job(WORKERS / "steady.py", env, nnodes=2, nproc=1)
    try:
        wait_for(lambda: _relay_pids(rings, 1), 90, "node 1's relay")
        time.sleep(1.0)
        (relay,) = _relay_pids(rings, 1)
        (worker,) = rank_pids(rings, 1)
        for pid in (relay, worker):  # node 1 is lost: its relay, its rank, its torchrun
            os.kill(pid, signal.SIGKILL)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        rc, out, err = col.wait(60)
        took = time.monotonic() - killed
    finally:
        for pid in rank_pids(rings, 0) | rank_pids(rings, 1) | _relay_pids(rings, 0):
            with contextlib.suppress(OSError):  # what is left of node 0 when an assert failed
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert rc == 3, err[-3000:]  # the run did not finish
    assert "silent for 5 s" in err or "said goodbye or died" in err, err[-2000:]
    assert took < 5 + 30, took  # rank 0 dies of its peer's loss, then 5 s of silence


def test_a_sharded_collector_routes_drop_ranges_to_their_shard(tmp_path):
    """``collect --shards``: rank 1 dropped its last collective (seq 5: no later record
    excuses it) and said so; the router sends the range to that group's shard."""
    from commcheck.collector.shards import ShardedPipeline
    from commcheck.collector.store import Store
    from commcheck.wire import (
        PHASE_COMPLETE,
        PHASE_ENTRY,
        BatchBuilder,
        DropRange,
        encode,
        try_decode,
    )

    from ..records import WORLD
    from ..unit.test_dropped import done, entry

    found: list = []
    p = ShardedPipeline(2, Store.create(str(tmp_path / "db"), "rows"), 4, 30.0, found.append,
                        lambda e: None)
    try:
        items = []
        for r in WORLD:
            recs = [x for s in range(6) if not (r == 1 and s == 5)
                    for x in (entry(s, 100.0 + s), done(s, 100.0 + s))]
            items.append(encode(BatchBuilder("r", r, "h", 4).build(recs, 1)))
        env = BatchBuilder("r", 1, "h", 4).build([], 2)
        env.drops = [DropRange("0", list(WORLD), phase, 5, 5)
                     for phase in (PHASE_ENTRY, PHASE_COMPLETE)]
        items.append(encode(env))
        p.feed_decoded([(data, try_decode(data)) for data in items])
        p.close_run(time.time())
        p.persist()
        assert found == []
        c = p.counters()
        assert (c["verified"], c["not_verified"], c["not_verified.1"]) == (5, 1, 1)
    finally:
        p.stop()
