"""Where a relay sends: one ZeroMQ DEALER to the collector's ROUTER for every rank it
serves (acknowledged delivery, see :mod:`commcheck.collector.ledger`), or one dump file per
rank (``COMMCHECK_DUMP_DIR``, no collector)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..wire import DUMP_MAGIC, WireError, decode, read_frames, write_frame
from ..wire.acks import decode_acks
from ..wire.keys import ClientKeys, secure_client
from ..wire.private import open_mine
from .folders import run_dir_name

HEARTBEAT_TIMEOUT_MS = 30_000
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_WATCHED = _REFUSED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def refusal(event: dict) -> str:
    """Why the collector refused the handshake, in words."""
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "refused this relay's CURVE client key (not in its clients/)"
    if int(event["value"]) == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "did not accept the handshake (is the server key the collector's?)"
    if int(event["value"]) == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "wants CURVE keys and this relay has none, or the other way round"
    return "refused the handshake"


class Outages:
    """Stretches in which messages waited and no acknowledgement came (the collector not
    up yet, a cut link, a refusal): an outage once it lasted ``least`` seconds. Measured
    by acks, not by the connection: a partition leaves the TCP connection up for as long
    as the heartbeat timeout (30 s), and a collector that is up but not answering is as
    unreachable for the ranks."""

    def __init__(self, least: float):
        self.least = least
        self.quiet_since: float | None = None  # messages waiting, no ack since
        self.seconds = 0.0  # in outages that ended
        self.count = 0

    def tick(self, now: float, acked: bool, waiting: bool) -> None:
        if acked:
            if self.quiet_since is not None and now - self.quiet_since >= self.least:
                self.seconds += now - self.quiet_since
                self.count += 1
            self.quiet_since = now if waiting else None
        elif waiting and self.quiet_since is None:
            self.quiet_since = now
        elif not waiting and self.quiet_since is not None and \
                now - self.quiet_since < self.least:
            self.quiet_since = None

    def total(self, now: float) -> tuple[float, int]:
        """(seconds, outages), the current one too."""
        cur = now - self.quiet_since if self.quiet_since is not None else 0.0
        if cur < self.least:
            return self.seconds, self.count
        return self.seconds + cur, self.count + 1


class ZmqLink:
    """A DEALER connected to the collector's ROUTER; :meth:`acks` reads its acknowledgements.

    Heartbeats notice a silently dead link (a cut cable) and reconnect after 30 s.
    ``IMMEDIATE`` stays off: with it, libzmq discards acks that arrived just before the
    collector closed the connection. So while no connection is up, up to ``hwm`` messages
    queue in libzmq (a second, small bound next to the outboxes'); beyond that a send fails
    and the message waits in its rank's outbox.
    """

    def __init__(self, endpoint: str, hwm: int = 64, curve: ClientKeys | None = None):
        self.endpoint = endpoint
        # what the connection went through (the monitor's events, read by :meth:`watch`)
        self.up = False
        self.refused = ""  # why the collector refused the last handshake; "" once one worked
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
        self.monitor = self.sock.get_monitor_socket(_WATCHED)
        self.monitor.linger = 0
        self.sock.connect(endpoint)

    def watch(self) -> list[str]:
        """Read the connection's events (never blocks); returns the refusals seen."""
        refused = []
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return refused
            except zmq.ZMQError:
                return refused
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up, self.refused = True, ""
            elif kind & _REFUSED:
                self.refused = refusal(event)
                refused.append(self.refused)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.up = False

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
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close(linger=int(linger * 1000))
        self.ctx.term()


def dump_path(dump_dir: str, run: str, rank: int) -> Path:
    """Where a rank's dump file goes when nobody stood in the way (see :mod:`.folders`)."""
    return Path(dump_dir) / run_dir_name(run) / f"rank{rank:05d}.ccw"


class FileSink:
    """A rank's dump file: the wire format, framed. Each message is flushed when written (it
    counts as delivered then). ``append`` continues a file a previous relay started for the
    same ring: a torn last frame is cut off, and :attr:`last_seq` says which of the rank's
    messages (by ``pid``) are in it already, so a restart writes none twice."""

    def __init__(self, path: Path, append: bool = False, pid: int = 0):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self.last_seq = -1
        if path.exists() and path.stat().st_size:
            # Never overwrite: a rank patched again in the same run (a new ring) appends
            # after what its earlier rings left; only a torn last frame is cut off. Only a
            # file of ours alone is read back (raises NotPrivate otherwise).
            fd = open_mine(path, os.O_RDWR)
            self.f = os.fdopen(fd, "r+b")
            good = self._scan(pid)
            self.f.truncate(good)
            self.f.close()
            if not append:
                self.last_seq = -1  # the seqs of an earlier ring say nothing about this one
        else:
            fd = open_mine(path, os.O_WRONLY | os.O_CREAT)
            with os.fdopen(fd, "wb") as f:
                f.truncate(0)
                f.write(DUMP_MAGIC)
        fd = open_mine(path, os.O_WRONLY | os.O_APPEND)
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
