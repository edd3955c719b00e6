"""Hostile messages at a live ``commcheck collect`` socket (real subprocess, real DEALER
sockets, real SQLite), with a well-behaved rank sending in between.

The collector must survive everything, store exactly the records of the messages that
decode (the valid rank's, plus mutants that happen to still be valid batches, each name
(run, rank, pid, seq) once: the collector drops duplicates), count every
rejection under the decoder's reason, and keep the valid rank's records verified.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commcheck.wire import MAX_MESSAGE_BYTES, STATUS, WireError, decode

from ..fuzzing import hostile
from ..harness import start_collector
from ..senders import Push, Rank, wait_counters
from ..stored import stored as stored_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VALID_RUN = "fuzz-valid"


@pytest.mark.timeout(120)
def test_collector_survives_hostile_senders(tmp_path):
    col = start_collector(tmp_path, 1, "--hang-timeout", "600")
    rejected: Counter[str] = Counter()
    stored: Counter[str] = Counter()
    names: set[tuple] = set()  # delivery is exactly-once by (run, rank, pid, seq)
    valid = Rank(VALID_RUN)
    claims = {valid.rank: (VALID_RUN, 1)}  # who speaks for each rank (collector/claims.py)
    good, bad = Push(col.endpoint), Push(col.endpoint)
    try:
        good.send(valid.hello())

        @settings(max_examples=200, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(hostile, min_size=1, max_size=4), st.integers(1, 3))
        def round_(payloads: list[bytes], n_valid: int) -> None:
            for data in payloads:
                try:
                    batch = decode(data)
                except WireError as e:
                    rejected[e.reason] += 1
                else:
                    if batch.env.run == VALID_RUN or batch.env.rank == valid.rank:
                        continue  # the engine tracks ranks by number: keep rank 0 the valid one
                    env = batch.env
                    speaks = [(s.rank, (env.run, s.pid)) for s in env.status] \
                        if env.kind == STATUS else [(env.rank, (env.run, env.pid))]
                    if any(claims.get(r, who) != who for r, who in speaks):
                        continue  # a second sender for a rank: refused (test_claims.py),
                        # in an order the ledger's holding makes hard to predict here
                    claims.update(speaks)
                    if (env.run, env.rank, env.pid, env.seq) not in names:
                        stored[batch.env.run] += len(batch.records)  # else: a duplicate
                    names.add((env.run, env.rank, env.pid, env.seq))
                bad.send(data)
            good.send(valid.batch(n_valid))

        round_()
        oversized = b"\x00" * (MAX_MESSAGE_BYTES + 1)
        bad.send(oversized)
        rejected["too_large"] += 1
        good.send(valid.goodbye())
        stored[VALID_RUN] += valid.sent
        want = {f"rejected.{k}": v for k, v in rejected.items()}
        wait_counters(col.db, lambda c: c.get("records", -1) == sum(stored.values()) and
                      all(c.get(k) == v for k, v in want.items()), timeout=60)
    finally:
        good.close()
        bad.close(linger_ms=0)
    assert col.proc.poll() is None, "the collector died"
    rc, out, err = col.terminate()
    assert "Traceback" not in err
    with stored_records(col.db) as conn:
        findings = conn.execute("SELECT COUNT(*) FROM findings").fetchone()[0]
        runs = Counter(dict(conn.execute("SELECT run, COUNT(*) FROM records GROUP BY run")))
        counters = dict(conn.execute("SELECT key, value FROM counters"))
        valid_seqs = [s for (s,) in conn.execute(
            "SELECT seq FROM records WHERE run = ? ORDER BY seq", (VALID_RUN,))]
        valid_findings = conn.execute("SELECT COUNT(*) FROM findings WHERE run = ?",
                                      (VALID_RUN,)).fetchone()[0]
        no_goodbye = conn.execute("SELECT COUNT(*) FROM ranks WHERE goodbye = 0").fetchone()[0]
        heard = {r for (r,) in conn.execute("SELECT rank FROM ranks")}
        goodbye = conn.execute(  # rows of earlier run sets linger: pick the goodbye one
            "SELECT goodbye, counters FROM ranks WHERE run LIKE ? AND rank = 0 "
            "ORDER BY goodbye DESC", (f"%{VALID_RUN}%",)).fetchone()
    # mutants that still decode may leave collectives that never complete (findings of
    # their runs) and ranks that never say goodbye (a run that did not finish: 3)
    never_heard = set(range(counters.get("world", 0))) - heard
    unfinished = no_goodbye or never_heard or not sum(runs.values())
    assert rc == (3 if unfinished else 1 if findings else 0), err
    assert runs == stored
    assert {k: v for k, v in counters.items() if k.startswith("rejected.")} == want
    assert valid_seqs == list(range(valid.sent))
    assert valid_findings == 0
    assert goodbye is not None and goodbye[0] == 1
    assert json.loads(goodbye[1])["records"] == valid.sent


@pytest.mark.timeout(120)
def test_rejections_are_counted_across_a_restart(tmp_path):
    """A restarted collector goes on from the committed rejection counts instead of
    overwriting them with its own."""
    db = tmp_path / "run.db"
    for total in (1, 2):
        col = start_collector(tmp_path, 1, db=db)
        bad = Push(col.endpoint)
        try:
            bad.send(b"\x00 not a batch")
            wait_counters(db, lambda c, total=total: sum(
                v for k, v in c.items() if k.startswith("rejected.")) == total)
        finally:
            bad.close(linger_ms=0)
        rc, _, err = col.terminate()
        assert rc == 3 and "Traceback" not in err, err  # nothing recorded: never clean
    with sqlite3.connect(db) as conn:
        counters = dict(conn.execute("SELECT key, value FROM counters"))
    assert sum(v for k, v in counters.items() if k.startswith("rejected.")) == 2
