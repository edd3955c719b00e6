"""Moving a rank's records off the training thread: the sender thread and its sinks.

The training thread only appends to a bounded deque (:meth:`Sender.submit`); a daemon
thread resolves device fingerprints whose events fired, batches records and hands the
encoded bytes to a sink: a ZeroMQ DEALER to the collector's ROUTER (acknowledged delivery,
see :mod:`commcheck.collector.ledger`), or a per-rank dump file. Only that thread touches
sockets and files. Batches wait for the collector's ack in a bounded outbox
(``buffer_bytes``); beyond it they spill to a file under ``spill_dir`` (re-sent when there is
room again) or are dropped, and either is counted; the counts reach the collector with the
next message.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Protocol

import zmq

from ..wire import (
    DUMP_MAGIC,
    GOODBYE,
    HELLO,
    REC_DTYPE,
    RECORDS,
    BatchBuilder,
    Envelope,
    Record,
    encode,
    write_frame,
)
from ..wire.acks import decode_acks
from ..wire.keys import ClientKeys, secure_client
from .config import Config
from .outbox import Outbox
from .spill import Spill

log = logging.getLogger("commcheck")


class Pending(Protocol):
    """Something that becomes a Record once its device work finished."""

    def ready(self) -> bool: ...

    def finalize(self) -> Record: ...


class Sink(Protocol):
    def send(self, payload: bytes) -> bool: ...

    def close(self, linger: float) -> None: ...


HEARTBEAT_TIMEOUT_MS = 30_000


class ZmqSink:
    """A DEALER connected to the collector's ROUTER; :meth:`acks` reads its acknowledgements.

    Heartbeats notice a silently dead link (a cut cable) and reconnect after 30 s.
    ``IMMEDIATE`` stays off: with it, libzmq discards acks that arrived just before the
    collector closed the connection. So while no connection is up, up to ``hwm`` messages
    queue in libzmq (a second, small bound next to the outbox's); beyond that a send fails
    and the batch waits in the outbox.
    """

    acked = True

    def __init__(self, endpoint: str, hwm: int = 16, curve: ClientKeys | None = None):
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

    @classmethod
    def for_config(cls, cfg: Config) -> ZmqSink:
        """The rank's sink to ``cfg.collector``, with CURVE keys when configured."""
        return cls(cfg.collector, curve=cfg.client_keys())

    def send(self, payload: bytes) -> bool:
        try:
            self.sock.send(payload, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def acks(self) -> list[tuple[int, int]]:
        """(pid, seq) of every message the collector acknowledged since the last call."""
        out: list[tuple[int, int]] = []
        while True:
            try:
                msg = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.extend(decode_acks(msg))

    def close(self, linger: float) -> None:
        self.sock.close(linger=int(linger * 1000))
        self.ctx.term()


def dump_path(dump_dir: str, run: str, rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run) or "run"
    return Path(dump_dir) / safe / f"rank{rank:05d}.ccw"


class FileSink:
    acked = False

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "wb")  # noqa: SIM115 - owned for the sink's lifetime
        self.f.write(DUMP_MAGIC)

    def send(self, payload: bytes) -> bool:
        write_frame(self.f, payload)
        return True

    def close(self, linger: float) -> None:
        self.f.close()


class Sender:
    def __init__(self, builder: BatchBuilder, sink: Sink, batch_records: int,
                 flush_interval: float, queue_records: int, buffer_bytes: int = 4 << 20,
                 spill: Spill | None = None, ack_timeout: float = 2.0):
        self.builder = builder
        self.sink = sink
        self.batch_records = batch_records
        self.flush_interval = flush_interval
        self.queue_records = queue_records
        self.counters = {"records": 0, "dropped": 0, "spilled": 0, "resent": 0,
                         "unsent_batches": 0, "errors": 0}
        self.outbox = Outbox(buffer_bytes, ack_timeout) if getattr(sink, "acked", False) \
            else None
        self.spill = spill
        self._q: deque[Pending] = deque()
        self._waiting: deque[Pending] = deque()
        self._ready: list[Record] = []
        self._seq = 0
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commcheck-sender", daemon=True)

    def start(self) -> None:
        """Queue the hello and start the thread. With an acked sink the hello only enters
        the outbox here (the caller may be the training thread); the sender thread sends it."""
        self._send(self.builder.control(HELLO, self._next_seq(), time.time(), self._pid))
        self._thread.start()
        self._wake.set()  # the hello goes out now: a rank may die within milliseconds

    def submit(self, item: Pending) -> None:
        """Called on the training thread: O(1), never blocks."""
        if len(self._q) + len(self._waiting) >= self.queue_records:
            self.counters["dropped"] += 1
            return
        self._q.append(item)
        if len(self._q) >= self.batch_records:
            self._wake.set()

    def close(self, linger: float) -> None:
        """Deliver what is queued (waiting at most ``linger`` s for device work and acks),
        say goodbye. What the collector never acknowledged stays in the spill file (if any)
        and is counted in the log line."""
        deadline = time.monotonic() + linger
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=linger + 1.0)
        self._drain(deadline=deadline)
        self._flush()
        lost = len(self._waiting) + len(self._q)
        self.counters["dropped"] += lost
        if self.outbox is not None:  # the goodbye's counters must be the final ones
            self._deliver(deadline - min(1.0, linger / 2))
        self._send(self.builder.control(GOODBYE, self._next_seq(), time.time(), self._pid,
                                        counters=dict(self.counters)))
        if self.outbox is None:
            self.sink.close(linger)
            return
        self._deliver(deadline)
        left = self.outbox.records() + (self.spill.records if self.spill else 0)
        if self.outbox or (self.spill and self.spill.pending):
            unacked = len(self.outbox) + (self.spill.pending if self.spill else 0)
            kept = self._spill_rest()
            if self.spill is not None:
                self.spill.keep()
            log.warning("commcheck: the collector did not acknowledge %d batch(es) (%d "
                        "records) before exit%s", unacked, left,
                        f"; kept in {self.spill.path}" if kept and self.spill else "")
        elif self.spill is not None:
            self.spill.discard()
        self.sink.close(0)

    def _deliver(self, deadline: float) -> None:
        while (self.outbox or (self.spill and self.spill.pending)) and \
                time.monotonic() < deadline:
            self._pump()
            time.sleep(0.01)

    def _spill_rest(self) -> int:
        if self.spill is None:
            return 0
        n = 0
        for entry in self.outbox.entries():
            n += self.spill.put(entry.seq, entry.pid, entry.payload, entry.records)
        return n + self.spill.pending

    def _next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def _send(self, env: Envelope) -> None:
        try:
            n = len(env.records) // REC_DTYPE.itemsize
            if self.outbox is None:
                if not self.sink.send(encode(env)):
                    self.counters["unsent_batches"] += 1
                    self.counters["dropped"] += n
                return
            env.pid = self._pid  # (run, rank, pid, seq) names a message for dedup
            payload = encode(env)
            if (self.spill is None or not self.spill.pending) and \
                    self.outbox.add(env.seq, self._pid, payload, n):
                return
            if self.spill is not None and self.spill.put(env.seq, self._pid, payload, n):
                self.counters["spilled"] += n
                return
            if env.kind != RECORDS and self.outbox.add(env.seq, self._pid, payload, n,
                                                       force=True):
                return  # control messages are tiny: never lose a hello or goodbye
            self.counters["unsent_batches"] += 1
            self.counters["dropped"] += n
            if env.seq == self._seq - 1:
                self._seq -= 1  # a dropped batch takes no number: the collector sees no gap
        except Exception as e:  # never let the sender thread die on one bad send
            self.counters["errors"] += 1
            log.warning("commcheck: send failed: %s", e)

    def _pump(self) -> None:
        """Take acks, move spilled batches back while there is room, (re)send what is due."""
        out = self.outbox
        if out is None:
            return
        try:
            out.acked(self.sink.acks())  # type: ignore[attr-defined]
            while self.spill is not None and self.spill.pending:
                head = self.spill.peek()
                if head is None or not out.room(head):
                    break
                seq, pid, payload, n = self.spill.take()
                out.add(seq, pid, payload, n, force=True)
            self.counters["resent"] += out.send_due(self.sink.send, time.monotonic())
        except Exception as e:
            self.counters["errors"] += 1
            log.warning("commcheck: delivery error: %s", e)

    def _drain(self, deadline: float | None = None) -> None:
        while self._q:
            self._waiting.append(self._q.popleft())
        while self._waiting:
            head = self._waiting[0]
            try:
                if not head.ready():
                    if deadline is None or time.monotonic() > deadline:
                        return
                    time.sleep(0.001)
                    continue
                self._ready.append(head.finalize())
            except Exception as e:
                self.counters["errors"] += 1
                log.warning("commcheck: dropping a record: %s", e)
            self._waiting.popleft()
            if len(self._ready) >= self.batch_records:
                self._flush()

    def _flush(self) -> None:
        while self._ready:
            chunk, self._ready = self._ready[:self.batch_records], self._ready[self.batch_records:]
            self.counters["records"] += len(chunk)
            self._send(self.builder.build(chunk, self._next_seq(), time.time(),
                                          counters=dict(self.counters)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            try:
                self._drain()
                self._flush()
            except Exception as e:
                self.counters["errors"] += 1
                log.warning("commcheck: sender error: %s", e)
            self._pump()
