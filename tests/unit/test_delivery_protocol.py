"""The delivery protocol's pieces alone: the collector's seen-set and ledger, the relay's outbox,
the relays' status messages in the collector."""

from __future__ import annotations

import sqlite3
import time

import pytest

from commcheck.collector.ledger import Ledger, _Seen
from commcheck.relay.outbox import Outbox
from commcheck.wire import BatchBuilder, WireError

from ..records import rec


def _bodies(admitted: list) -> list[bytes]:
    assert all(not isinstance(b, WireError) and b.env.seq >= 0 for _, b in admitted)
    return [data for data, _ in admitted]


def test_seen_set_is_compact_and_exact():
    s = _Seen()
    for x in (3, 0, 1, 5, 2):
        s.add(x)
    assert [x in s for x in range(7)] == [True, True, True, True, False, True, False]
    assert s.low == 4 and s.above == {5}

def test_outbox_bounds_bytes_resends_with_backoff_and_forgets_acked():
    box = Outbox(max_bytes=100, ack_timeout=1.0)
    assert box.add(0, 9, b"x" * 60, 3) and not box.add(1, 9, b"y" * 60, 3)
    assert box.add(1, 9, b"y" * 10, 1)
    sent: list[bytes] = []
    assert box.send_due(lambda p: sent.append(p) or True, now=10.0) == 0
    assert box.send_due(lambda p: sent.append(p) or True, now=10.5) == 0  # not due yet
    assert box.send_due(lambda p: sent.append(p) or True, now=11.1) == 2  # re-sent
    assert box.send_due(lambda p: sent.append(p) or True, now=12.2) == 0  # backed off to 2 s
    assert len(sent) == 4
    box.acked([(9, 0), (9, 7)])
    assert len(box) == 1 and box.bytes == 10 and box.records() == 1
    refused = Outbox(100, 1.0)
    refused.add(0, 1, b"z", 1)
    assert refused.send_due(lambda p: False, now=1.0) == 0 and next(refused.entries()).sent == 0

def _kept(ledger: Ledger) -> list[bytes | None]:
    """The bodies the ledger kept (--keep-bodies), in arrival order."""
    return [b for (b,) in ledger.conn.execute("SELECT body FROM delivered ORDER BY rowid")]


def test_ledger_drops_duplicates_across_a_restart(tmp_path):
    from commcheck.wire import encode

    b = BatchBuilder("r", 0, "h", 1)
    msgs = [encode(b.build([rec(seq=i, ranks=(0,))], i)) for i in range(3)]
    conn = sqlite3.connect(tmp_path / "l.db")
    led = Ledger(conn, bodies=True)
    assert _bodies(led.admit([(b"a", msgs[0]), (b"a", msgs[1]), (b"a", msgs[0])])) == msgs[:2]
    (garbage, error), = led.admit([(b"", b"garbage")])  # passed on, to be rejected
    assert garbage == b"garbage" and isinstance(error, WireError)
    acks: list[tuple[bytes, bytes]] = []
    led.send_acks(lambda i, p: acks.append((i, p)))
    assert len(acks) == 1 and acks[0][0] == b"a"
    conn.commit()
    conn.close()
    again = Ledger(sqlite3.connect(tmp_path / "l.db"), bodies=True)
    assert _bodies(again.admit([(b"b", msgs[1]), (b"b", msgs[2])])) == [msgs[2]]
    assert _kept(again) == msgs  # in arrival order
    # By default only names are kept (the engine's snapshot is the restart point).
    names_only = Ledger(sqlite3.connect(tmp_path / "n.db"))
    assert _bodies(names_only.admit([(b"a", m) for m in msgs])) == msgs
    assert _kept(names_only) == [None] * 3 and names_only.delivered() == 3

def test_ledger_feeds_each_sender_in_order_and_gives_up_on_a_gap_after_max_hold(tmp_path):
    from commcheck.wire import encode

    b = BatchBuilder("r", 0, "h", 1)
    m = [encode(b.build([rec(seq=i, ranks=(0,))], i)) for i in range(5)]
    led = Ledger(sqlite3.connect(tmp_path / "o.db"), max_hold=5.0)
    assert _bodies(led.admit([(b"a", m[0]), (b"a", m[2]), (b"a", m[3])], now=0.0)) == [m[0]]
    assert _bodies(led.admit([(b"a", m[2])], now=1.0)) == []  # still held, not acked
    assert led.owed == {b"a": [(0, 0)]}
    assert _bodies(led.admit([(b"a", m[1])], now=2.0)) == [m[1], m[2], m[3]]  # the gap filled
    assert _bodies(led.admit([(b"a", m[4])], now=3.0)) == [m[4]]
    m2 = [encode(BatchBuilder("s", 0, "h", 1).build([rec(seq=i, ranks=(0,))], i))
          for i in range(3)]
    assert _bodies(led.admit([(b"c", m2[0]), (b"c", m2[2])], now=10.0)) == [m2[0]]
    assert _bodies(led.admit([], now=16.0)) == [m2[2]]  # gave up on seq 1 after max_hold
    assert _bodies(led.admit([(b"c", m2[1])], now=17.0)) == [m2[1]]  # accepted late, not a dup
    assert _bodies(led.admit([(b"c", m2[1])], now=18.0)) == []


def test_status_messages_pass_the_ledger_unnamed_and_the_latest_per_rank_is_stored(tmp_path):
    """A relay's status messages are observations: never deduplicated, never acked, handed
    to the engine as liveness (the latest per rank), never as records; the collector keeps
    the latest per rank (rank_status) and says in its live view who is gone."""
    from commcheck.collector.daemon import Collector, CollectorOptions
    from commcheck.collector.store import Store
    from commcheck.wire import RankStatus, encode

    b = BatchBuilder("r", 0, "node1", 4, node=1)
    seen = [RankStatus(rank=0, pid=10, state="alive", idle=0.2, records=6),
            RankStatus(rank=1, pid=11, state="alive")]
    first = encode(b.status(0, 100.0, 99, seen))
    later = encode(b.status(1, 101.0, 99, [
        seen[0], RankStatus(rank=1, pid=11, state="gone", signal=9, idle=3.5, records=8)]))
    conn = sqlite3.connect(tmp_path / "l.db")
    led = Ledger(conn)
    out = led.admit([(b"a", first), (b"a", first), (b"a", later)])
    assert [data for data, _ in out] == [first, first, later]  # no dedup for observations
    led.send_acks(lambda i, p: pytest.fail("a status message was acked"))
    assert led.delivered() == 0

    col = Collector(CollectorOptions(bind="tcp://127.0.0.1:*", world_size=4,
                                     db=str(tmp_path / "c.db")))
    try:
        assert col.ingest([(b"a", later), (b"a", first)]) == 0  # not the job's activity
        lv = {r: s.liveness for r, s in col.engine.ranks.items()}  # the latest (t 101) wins
        assert (lv[0].state, lv[1].state, lv[1].signal, lv[1].seen_t) == ("alive", "gone", 9,
                                                                          101.0)
        assert col.engine.stats.records == 0
        line = col.status_line()
        assert "1 alive, 1 gone" in line and "rank 1 gone (signal 9" in line
        col.maintain(time.monotonic() + 10)  # commits
        rows = {s["rank"]: s for s in Store(col.store.conn).statuses()}
        assert rows[1]["state"] == "gone" and rows[1]["signal"] == 9
        assert rows[1]["relay_pid"] == 99 and rows[1]["node"] == 1 and rows[0]["records"] == 6
    finally:
        col.receiver.close()
        col.pipeline.stop()
        col.store.close()
