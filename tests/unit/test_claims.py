"""Who speaks for a rank (collector/claims.py), through the real collector's ingest path
(ledger, claims, engine, SQLite): a second process sending as a rank, with its hello, its
records, its goodbye or its relay's status, never counts for the run, and is named."""

from __future__ import annotations

import time

from commcheck.collector.daemon import Collector, CollectorOptions
from commcheck.collector.report import load
from commcheck.wire import GOODBYE, HELLO, BatchBuilder, RankStatus, encode

from ..records import rec

RUN = "job"


class Sender:
    """One process sending as ``rank``: its messages named (run, rank, pid, seq)."""

    def __init__(self, rank: int, pid: int, run: str = RUN, host: str = "node0"):
        self.b = BatchBuilder(run, rank, host, 2)
        self.pid, self.seq, self.sent = pid, 0, 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def hello(self) -> bytes:
        return encode(self.b.control(HELLO, self._next(), time.time(), self.pid))

    def batch(self, seqs: range, out=(1, 1)) -> bytes:
        env = self.b.build([rec(seq=s, ranks=(0, 1), out=out) for s in seqs], self._next(),
                           time.time())
        env.pid = self.pid
        self.sent += len(seqs)
        return encode(env)

    def goodbye(self) -> bytes:
        return encode(self.b.control(GOODBYE, self._next(), time.time(), self.pid,
                                     counters={"records": self.sent}))

    def status(self, state: str, relay_pid: int = 7) -> bytes:
        return encode(self.b.status(self._next(), time.time(), relay_pid, [
            RankStatus(rank=self.b.rank, pid=self.pid, state=state)]))


def collector(tmp_path) -> Collector:
    return Collector(CollectorOptions(bind="tcp://127.0.0.1:*", world_size=2,
                                      db=str(tmp_path / "c.db")))


def close(col: Collector) -> None:
    col.receiver.close()
    col.pipeline.stop()
    col.store.close()


def feed(col: Collector, *payloads: bytes, who: bytes = b"relay") -> None:
    col.ingest([(who, p) for p in payloads])


def test_another_senders_goodbye_never_ends_the_run(tmp_path):
    r0, r1 = Sender(0, pid=100), Sender(1, pid=101)
    fake0, fake1 = Sender(0, pid=666), Sender(1, pid=667)  # the job's run id, other pids
    other0 = Sender(0, pid=668, run="other")  # another run id, the same rank numbers
    col = collector(tmp_path)
    try:
        feed(col, r0.hello(), r1.hello(), r0.batch(range(3)), r1.batch(range(3)))
        feed(col, fake0.hello(), fake0.batch(range(3, 6), out=(9, 9)), fake0.goodbye(),
             fake1.hello(), fake1.goodbye(), other0.hello(), other0.goodbye(),
             fake1.status("gone"), who=b"intruder")
        assert not col.engine.done and col.done(time.monotonic()) == ""
        assert col.engine.stats.records == 6
        assert col.rejected["foreign_sender"] == 8
        feed(col, r0.goodbye())
        assert not col.engine.done  # rank 1's own goodbye is still missing
        feed(col, r1.batch(range(3, 5)), r1.goodbye(), r0.batch(range(3, 5)))
        assert col.engine.done
        col.maintain(time.monotonic() + 10)
        findings, summary = load(col.store)
    finally:
        close(col)
    assert findings == [] and summary.verified == 5 and summary.records == 10
    assert summary.rejected == {"foreign_sender": 8}
    named = {r.who: r.count for r in summary.refused}
    assert named == {"pid 666 on node0 as rank 0 of run job": 3,
                     "pid 667 on node0 as rank 1 of run job": 2,
                     "pid 667 on node0 as rank 1 of run job (its relay's status)": 1,
                     "pid 668 on node0 as rank 0 of run other": 2}
    assert {r.reason for r in summary.refused} == {"foreign_sender"}
    assert summary.open_collector  # no --curve-dir: said in the report


def test_claims_survive_a_restart_and_end_only_as_the_holder_does(tmp_path):
    r0, r1 = Sender(0, pid=100), Sender(1, pid=101)
    col = collector(tmp_path)
    try:
        feed(col, r0.hello(), r1.hello(), r0.batch(range(2)), r1.batch(range(2)))
        col.maintain(time.monotonic() + 10)
    finally:
        close(col)
    col = collector(tmp_path)  # restarted on the same database
    try:
        late = Sender(0, pid=200)
        feed(col, late.hello(), late.batch(range(2, 4)))
        assert col.rejected["foreign_sender"] == 2
        feed(col, r0.status("gone"))  # its relay saw the holder's process end
        feed(col, late.batch(range(2, 4)))  # a restarted process may now speak for rank 0
        assert col.rejected["foreign_sender"] == 2
        feed(col, r1.goodbye())
        same_run = Sender(1, pid=300)
        feed(col, same_run.hello())  # after rank 1's goodbye: not by another pid of its run
        assert col.rejected["foreign_sender"] == 3
        next_run = Sender(1, pid=301, run="next")
        feed(col, next_run.hello())  # but a new run may take the rank
        assert col.rejected["foreign_sender"] == 3
    finally:
        close(col)
