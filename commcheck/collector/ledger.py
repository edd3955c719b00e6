"""Acknowledged, exactly-once delivery between a node's relay and the collector.

Protocol (relay DEALER → collector ROUTER):

* Every message of a rank is named by ``(run, rank, pid, seq)``: ``seq`` numbers the
  messages of one rank, ``pid`` (the rank's) tells apart two processes that reuse a run id.
  The relay of the rank's node numbers them and sends them (one DEALER for the node's
  ranks); the rank itself holds no socket (it writes a ring file, see
  :mod:`commcheck.wire.ring`), and the relay journals each message's number and ring range
  before sending it, so a restarted relay re-sends the same messages under the same names.
* The relay keeps each message in the rank's :class:`Outbox` (bounded in bytes) until the
  collector acknowledges it, and re-sends it after ``ack_timeout`` seconds (doubling up to
  30 s while no ack arrives; the next ack resets the wait, so a healed link recovers
  quickly); acks map back to the ring, whose space the rank may then reuse.
* ``status`` messages (the relay's observations of its ranks) are outside this: not named,
  not acknowledged; they pass the ledger untouched.
* The collector (:class:`Ledger`) writes each new message's name into the ``delivered``
  table *in the same SQLite transaction* as its records, its findings and the engine's
  snapshot (snapshot.py), and sends the ack only after that transaction committed. So an
  acked message survives a kill -9 of the collector; an unacked one is re-sent by the
  rank. A message whose name is already in ``delivered`` (or seen since the last commit)
  is dropped and acked again.
* A collector restarted on the same database loads the engine's snapshot, so collectives
  that were half matched at the crash are matched as if nothing happened. With
  ``bodies=True`` (``commcheck collect --keep-bodies``) each message's body is kept too,
  for offline re-analysis (``commcheck analyze`` reads them where it cannot continue a
  snapshot: a sharded collector's).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable

from ..wire import STATUS, Decoded, WireError, try_decode
from ..wire.acks import encode_acks

log = logging.getLogger("commcheck")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS delivered (
    run TEXT NOT NULL, rank INTEGER NOT NULL, pid INTEGER NOT NULL, seq INTEGER NOT NULL,
    body BLOB, PRIMARY KEY (run, rank, pid, seq));
"""


class _Seen:
    """Sequence numbers seen from one sender: all in [``base``, ``low``) except ``skipped``,
    plus ``above``, plus ``early`` (below ``base``: the sender's first message to arrive had
    sequence number ``base``; what it sent before is accepted late, in any order)."""

    __slots__ = ("base", "low", "above", "skipped", "early")

    def __init__(self, first: int = 0) -> None:
        self.base = self.low = first
        self.above: set[int] = set()
        self.skipped: set[int] = set()
        self.early: set[int] = set()

    def __contains__(self, seq: int) -> bool:
        if seq < self.base:
            return seq in self.early
        return (seq < self.low and seq not in self.skipped) or seq in self.above

    def add(self, seq: int) -> None:
        if seq < self.base:
            self.early.add(seq)
            return
        if seq < self.low:
            self.skipped.discard(seq)
            return
        self.above.add(seq)
        while self.low in self.above:
            self.above.discard(self.low)
            self.low += 1

    def skip_to(self, seq: int) -> None:
        """Give up waiting for the gap below ``seq`` (accepted late if it ever comes)."""
        while self.low < seq:
            if self.low not in self.above:
                self.skipped.add(self.low)
            self.above.discard(self.low)
            self.low += 1


class Ledger:
    """The collector's memory of delivered messages, and the acks it owes.

    Messages of one sender are fed to the engine in ``seq`` order: one that arrives past a
    gap (its predecessor was lost in a crash or a cut link and is being re-sent) is held,
    unacknowledged, until the gap fills, or for at most ``max_hold`` seconds. Otherwise a
    complete record could reach the engine before the entry record of the same call.
    Senders number their messages without gaps (a batch they drop takes no number).
    """

    def __init__(self, conn: sqlite3.Connection, max_hold: float = 15.0,
                 max_held: int = 4096, bodies: bool = False):
        self.conn = conn
        self.bodies = bodies
        conn.executescript(_SCHEMA)
        self.seen: dict[tuple[str, int, int], _Seen] = {}
        self.held: dict[tuple[str, int, int], dict[int, tuple[bytes, bytes, float]]] = {}
        self.owed: dict[bytes, list[tuple[int, int]]] = {}
        self.max_hold, self.max_held = max_hold, max_held
        self.duplicates = 0
        for run, rank, pid, seq in conn.execute("SELECT run, rank, pid, seq FROM delivered "
                                                "ORDER BY run, rank, pid, seq"):
            self._seen(run, rank, pid, seq).add(seq)

    def _seen(self, run: str, rank: int, pid: int, first: int = 0) -> _Seen:
        s = self.seen.get((run, rank, pid))
        if s is None:  # a sender's first message sets where its order starts
            s = self.seen[(run, rank, pid)] = _Seen(first)
        return s

    def delivered(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM delivered").fetchone()[0]

    def admit(self, burst: list[tuple[bytes, bytes]], now: float | None = None) -> list[Decoded]:
        """The messages of ``burst`` (and held ones whose turn came) to feed now, in each
        sender's order, without the ones delivered before, each with its decoded batch;
        records their names (in the open transaction) and owes each sender an ack for every
        message accepted or duplicate. Messages that do not decode pass through with their
        error, unnamed and unacked, for the pipeline to reject and count: an invalid message
        never takes a valid one's name."""
        now = time.monotonic() if now is None else now
        fresh: list[Decoded] = []
        rows: list[tuple] = []
        for identity, data in burst:
            batch = try_decode(data)
            if isinstance(batch, WireError):
                fresh.append((data, batch))
                continue
            env = batch.env
            if env.kind == STATUS:  # an observation, not a rank's message: no name, no ack
                fresh.append((data, batch))
                continue
            key = (env.run, env.rank, env.pid)
            seen = self._seen(*key, env.seq)
            if env.seq in seen:
                self.duplicates += 1
                if identity:
                    self.owed.setdefault(identity, []).append((env.pid, env.seq))
                continue
            if env.seq > seen.low:  # a predecessor is missing: wait for it
                self.held.setdefault(key, {}).setdefault(env.seq, (identity, (data, batch),
                                                                   now))
                continue
            self._accept(key, env.seq, identity, (data, batch), fresh, rows)
        for key in list(self.held):
            held = self.held[key]
            if held and (len(held) > self.max_held or
                         now - min(t for _, _, t in held.values()) > self.max_hold):
                log.warning("commcheck collect: gave up waiting for messages %d.. of %s",
                            self.seen[key].low, key)
                self.seen[key].skip_to(min(held))
            self._accept(key, None, b"", None, fresh, rows)
        if rows:
            self.conn.executemany("INSERT OR IGNORE INTO delivered VALUES (?,?,?,?,?)", rows)
        return fresh

    def _accept(self, key: tuple[str, int, int], seq: int | None, identity: bytes,
                item: Decoded | None, fresh: list[Decoded], rows: list[tuple]) -> None:
        """Accept one message (``seq`` None: none), then the held ones now in order."""
        seen, run, rank, pid = self.seen[key], *key
        while True:
            if seq is not None and item is not None:
                seen.add(seq)
                rows.append((run, rank, pid, seq, item[0] if self.bodies else None))
                fresh.append(item)
                if identity:
                    self.owed.setdefault(identity, []).append((pid, seq))
            held = self.held.get(key)
            if not held or seen.low not in held:
                if held is not None and not held:
                    del self.held[key]
                return
            seq = seen.low
            identity, item, _ = held.pop(seq)

    def send_acks(self, send: Callable[[bytes, bytes], None]) -> None:
        """Call only after the transaction holding the admitted messages committed."""
        owed, self.owed = self.owed, {}
        for identity, names in owed.items():
            for i in range(0, len(names), 4096):
                send(identity, encode_acks(names[i:i + 4096]))
