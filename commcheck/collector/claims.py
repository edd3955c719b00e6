"""Who speaks for a rank: the first process heard of for it, until it is done.

The engine tracks ranks by number (``Engine.done`` counts goodbyes per rank), so a second
process sending as rank ``r`` (an intruder on an open collector, a stale relay of an earlier
run) could end the run with its goodbye or fill it with its records. A rank's messages are
named (run, rank, pid, seq), the pid being the rank's own process, the same across relay
restarts and reconnects (which change the connection, not the name; see ledger.py). So the
first message about rank ``r`` (its hello, or its relay's status entry) claims ``r`` for its
(run, pid); until the holder is done, a hello, records, a goodbye or a status entry for
``r`` under another (run, pid) is refused and counted (``foreign_sender``), never fed.

The holder is done when its relay reports its process gone (a restarted process may then
claim the rank) or when it said goodbye (only a *new run* may then claim the rank: a
collector can take several runs one after the other). Claims live in the database, written
in the transaction of the messages that made them, so a restarted collector keeps them.
See docs/security.md.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from ..wire import GONE, GOODBYE, STATUS, Decoded, Envelope, WireError

FOREIGN = "foreign_sender"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS claims (
    rank INTEGER PRIMARY KEY, run TEXT NOT NULL, pid INTEGER NOT NULL, host TEXT NOT NULL,
    state TEXT NOT NULL);
"""
HELD, SAID_GOODBYE, WENT = "held", "goodbye", "gone"

Refused = Callable[[str, str], None]  # (reason, who)


@dataclass
class Claim:
    run: str
    pid: int
    host: str
    state: str = HELD

    def admits(self, run: str, pid: int) -> bool:
        """Whether (run, pid) may speak for the rank: the holder, or a newcomer once the
        holder is gone, or (a new run) once it said goodbye."""
        if (run, pid) == (self.run, self.pid):
            return True
        return self.state == WENT or (self.state == SAID_GOODBYE and run != self.run)


class Claims:
    """The collector's claims on ranks; :meth:`screen` refuses what a claim does not
    admit, reporting each refusal through ``on_refused(reason, who)``."""

    def __init__(self, conn: sqlite3.Connection, on_refused: Refused):
        self.conn = conn
        self.on_refused = on_refused
        conn.executescript(_SCHEMA)
        self.held: dict[int, Claim] = {
            rank: Claim(run, pid, host, state)
            for rank, run, pid, host, state in conn.execute("SELECT * FROM claims")}

    def _take(self, rank: int, run: str, pid: int, host: str) -> bool:
        c = self.held.get(rank)
        if c is not None and (run, pid) == (c.run, c.pid):
            return True
        if c is not None and not c.admits(run, pid):
            return False
        self._set(rank, Claim(run, pid, host))
        return True

    def _set(self, rank: int, c: Claim) -> None:
        self.held[rank] = c
        self.conn.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?)",
                          (rank, c.run, c.pid, c.host, c.state))

    def _mark(self, rank: int, run: str, pid: int, state: str) -> None:
        c = self.held.get(rank)
        if c is not None and (run, pid) == (c.run, c.pid) and c.state != state:
            c.state = state
            self._set(rank, c)

    def screen(self, items: list[Decoded]) -> list[Decoded]:
        """``items`` with each message of a sender that does not hold its rank replaced by
        its rejection (a ``foreign_sender`` error, counted by the pipeline), and each such
        status entry removed from its status message (its rejection added after it)."""
        out: list[Decoded] = []
        for data, batch in items:
            if isinstance(batch, WireError):
                out.append((data, batch))
                continue
            env = batch.env
            if env.kind == STATUS:
                out.append((data, batch))
                out += [(b"", e) for e in self._screen_status(env)]
            elif self._take(env.rank, env.run, env.pid, env.host):
                if env.kind == GOODBYE:
                    self._mark(env.rank, env.run, env.pid, SAID_GOODBYE)
                out.append((data, batch))
            else:
                out.append((data, self._refuse(
                    env.rank, f"pid {env.pid} on {env.host} as rank {env.rank} of run {env.run}")))
        return out

    def _screen_status(self, env: Envelope) -> list[WireError]:
        """Drops the status entries of ranks their relay does not speak for; returns their
        rejections."""
        kept, refused = [], []
        for s in env.status:
            if self._take(s.rank, env.run, s.pid, env.host):
                kept.append(s)
                if s.state == GONE:
                    self._mark(s.rank, env.run, s.pid, WENT)
            else:
                refused.append(self._refuse(s.rank, f"pid {s.pid} on {env.host} as rank "
                                                    f"{s.rank} of run {env.run} (its relay's "
                                                    f"status)"))
        env.status = kept
        return refused

    def _refuse(self, rank: int, who: str) -> WireError:
        c = self.held[rank]
        e = WireError(FOREIGN, f"refused {who}: pid {c.pid} on {c.host} speaks for rank "
                               f"{rank} of run {c.run}")
        self.on_refused(FOREIGN, who)
        return e
