"""Test-side senders that talk to a real collector socket the way ranks do (DEALER, acks
ignored), and read its database while it runs."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from commcheck.wire import GOODBYE, HELLO, BatchBuilder, Record, encode
from commcheck.wire.keys import ClientKeys, secure_client

from .records import rec


class Push:
    """One fire-and-forget connection (a DEALER, the collector's ROUTER peer; its acks are
    never read); ``keys`` makes it a CURVE client."""

    def __init__(self, endpoint: str, keys: ClientKeys | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.sndtimeo = 5000
        self.sock.linger = 2000  # a context collected unclosed must not wait forever to send
        if keys is not None:
            secure_client(self.sock, keys)
        self.sock.connect(endpoint)

    def send(self, payload: bytes) -> None:
        self.sock.send(payload)

    def close(self, linger_ms: int = 2000) -> None:
        self.sock.close(linger=linger_ms)
        self.ctx.term()

    def __enter__(self) -> Push:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def records(n: int, seq0: int = 0) -> list[Record]:
    return [rec(seq=seq0 + i, ranks=(0,), callsite=f"valid.py:{seq0 + i} main")
            for i in range(n)]


class Rank:
    """A well-behaved single rank of a world of one: hello, batches, goodbye."""

    def __init__(self, run: str, rank: int = 0, world: int = 1):
        self.builder = BatchBuilder(run, rank, "testhost", world)
        self.rank = rank
        self.seq = 0
        self.sent = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def hello(self) -> bytes:
        return encode(self.builder.control(HELLO, self._next(), time.time(), 1))

    def batch(self, n: int) -> bytes:
        env = self.builder.build(records(n, self.sent), self._next(), time.time())
        env.pid = 1  # as a rank's sender does: (run, rank, pid, seq) names each message
        payload = encode(env)
        self.sent += n
        return payload

    def goodbye(self) -> bytes:
        return encode(self.builder.control(GOODBYE, self._next(), time.time(), 1,
                                           counters={"records": self.sent}))


def counters(db: Path) -> dict[str, int]:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return dict(conn.execute("SELECT key, value FROM counters"))
    except sqlite3.Error:
        return {}


def wait_counters(db: Path, ok: Callable[[dict[str, int]], bool],
                  timeout: float = 30) -> dict[str, int]:
    """Poll the collector's committed counters until ``ok`` holds (or fail after timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        c = counters(db)
        if ok(c):
            return c
        if time.monotonic() > deadline:
            raise AssertionError(f"collector counters never satisfied the condition: {c}")
        time.sleep(0.1)
