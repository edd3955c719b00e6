"""SIGTERM and SIGINT on a live `commcheck collect` (real subprocess, DEALER senders, real
SQLite). A scheduler (scancel, a time limit) signals the ranks, their relays and the
collector together: the collector still takes the goodbyes on their way, which say how
the ranks ended; a second signal stops it at once."""

from __future__ import annotations

import signal
import time

import pytest

from ..harness import start_collector
from ..senders import Push, Rank, counters, wait_counters
from ..stored import stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _goodbyes(db) -> int:
    with stored(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM ranks WHERE goodbye = 1").fetchone()[0]


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signalled_collector_takes_the_goodbyes_on_their_way_unless_signalled_twice(
        tmp_path, signals):
    col = start_collector(tmp_path, 1)
    rank = Rank("sig")
    with Push(col.endpoint) as push:
        push.send(rank.hello())
        push.send(rank.batch(5))
        wait_counters(col.db, lambda c: c.get("records") == 5)
        push.send(rank.batch(5))  # the job is busy when the signal comes
        for _ in range(signals):
            col.proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        time.sleep(0.3)
        push.send(rank.goodbye())
        rc, out, err = col.wait(30)
    assert "Traceback" not in err and "stopped (SIGTERM)" in err, err
    if signals == 1:
        assert (rc, _goodbyes(col.db), counters(col.db)["records"]) == (0, 1, 10), out
    else:  # at once: the goodbye came too late
        assert (rc, _goodbyes(col.db)) == (3, 0), out
