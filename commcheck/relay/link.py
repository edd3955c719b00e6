"""Where a relay sends: one ZeroMQ DEALER to the collector's ROUTER for every rank it
serves (acknowledged delivery, see :mod:`commcheck.collector.ledger`), or one dump file per
rank (``COMMCHECK_DUMP_DIR``, no collector)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import zmq

from ..wire import DUMP_MAGIC, WireError, decode, read_frames, write_frame
from ..wire.acks import decode_acks
from ..wire.keys import ClientKeys, secure_client

HEARTBEAT_TIMEOUT_MS = 30_000


class ZmqLink:
    """A DEALER connected to the collector's ROUTER; :meth:`acks` reads its acknowledgements.

    Heartbeats notice a silently dead link (a cut cable) and reconnect after 30 s.
    ``IMMEDIATE`` stays off: with it, libzmq discards acks that arrived just before the
    collector closed the connection. So while no connection is up, up to ``hwm`` messages
    queue in libzmq (a second, small bound next to the outboxes'); beyond that a send fails
    and the message waits in its rank's outbox.
    """

    def __init__(self, endpoint: str, hwm: int = 64, curve: ClientKeys | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # A link is declared dead after HEARTBEAT_TIMEOUT without traffic. A collector with a
        # full receive queue stops reading its socket, so heartbeats go unanswered while it
        # is merely busy: the timeout is long, and no TTL asks the collector to drop us.
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if curve is not None:
            secure_client(self.sock, curve)
        self.sock.connect(endpoint)

    def send(self, payload: bytes) -> bool:
        try:
            self.sock.send(payload, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def wait(self, timeout_ms: int) -> bool:
        """Block until an ack may be read, at most ``timeout_ms``."""
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def acks(self) -> list[tuple[int, int]]:
        """(pid, seq) of every message the collector acknowledged since the last call."""
        out: list[tuple[int, int]] = []
        while True:
            try:
                msg = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.extend(decode_acks(msg))

    def close(self, linger: float = 0.0) -> None:
        self.sock.close(linger=int(linger * 1000))
        self.ctx.term()


def dump_path(dump_dir: str, run: str, rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run) or "run"
    return Path(dump_dir) / safe / f"rank{rank:05d}.ccw"


class FileSink:
    """A rank's dump file: the wire format, framed. Each message is flushed when written (it
    counts as delivered then). ``append`` continues a file a previous relay started for the
    same ring: a torn last frame is cut off, and :attr:`last_seq` says which of the rank's
    messages (by ``pid``) are in it already, so a restart writes none twice."""

    def __init__(self, path: Path, append: bool = False, pid: int = 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.last_seq = -1
        if path.exists() and path.stat().st_size:
            # Never overwrite: a rank patched again in the same run (a new ring) appends
            # after what its earlier rings left; only a torn last frame is cut off.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            self.f = os.fdopen(fd, "r+b")
            good = self._scan(pid)
            self.f.truncate(good)
            self.f.close()
            if not append:
                self.last_seq = -1  # the seqs of an earlier ring say nothing about this one
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(DUMP_MAGIC)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        self.f = os.fdopen(fd, "ab")

    def _scan(self, pid: int) -> int:
        good = len(DUMP_MAGIC)
        try:
            for payload in read_frames(self.f):
                good += 4 + len(payload)
                with contextlib.suppress(WireError):
                    env = decode(payload).env
                    if env.pid == pid:
                        self.last_seq = max(self.last_seq, env.seq)
        except WireError:
            pass
        if good == len(DUMP_MAGIC):
            self.f.seek(0)
            self.f.write(DUMP_MAGIC)
        return good

    def send(self, payload: bytes) -> bool:
        write_frame(self.f, payload)
        self.f.flush()
        return True

    def close(self) -> None:
        self.f.close()
