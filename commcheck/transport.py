"""Moving encoded envelopes: the rank-side sender thread and the collector-side receiver.

The training thread only appends to a bounded deque (:meth:`Sender.submit`); a daemon
thread resolves device fingerprints whose events fired, batches records and hands the
encoded bytes to a sink (ZeroMQ PUSH, or a per-rank dump file). When the bound is hit,
records are dropped and counted; the count reaches the collector with the next message.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Protocol

import zmq

from .config import Config
from .security import ClientKeys, Gatekeeper, Reject, ServerKeys, client_keys, secure_client
from .wire import (
    DUMP_MAGIC,
    GOODBYE,
    HELLO,
    MAX_MESSAGE_BYTES,
    REC_DTYPE,
    BatchBuilder,
    Envelope,
    Record,
    encode,
    write_frame,
)

log = logging.getLogger("commcheck")


class Pending(Protocol):
    """Something that becomes a Record once its device work finished."""

    def ready(self) -> bool: ...

    def finalize(self) -> Record: ...


class Sink(Protocol):
    def send(self, payload: bytes) -> bool: ...

    def close(self, linger: float) -> None: ...


class ZmqSink:
    def __init__(self, endpoint: str, hwm: int = 1000, curve: ClientKeys | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        self.sock.setsockopt(zmq.IMMEDIATE, 0)
        if curve is not None:
            secure_client(self.sock, curve)
        self.sock.connect(endpoint)

    @classmethod
    def for_config(cls, cfg: Config) -> ZmqSink:
        """The rank's sink to ``cfg.collector``, with CURVE keys when configured."""
        return cls(cfg.collector, curve=client_keys(cfg))

    def send(self, payload: bytes) -> bool:
        try:
            self.sock.send(payload, copy=False)
            return True
        except zmq.Again:
            return False

    def close(self, linger: float) -> None:
        self.sock.close(linger=int(linger * 1000))
        self.ctx.term()


def dump_path(dump_dir: str, run: str, rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run) or "run"
    return Path(dump_dir) / safe / f"rank{rank:05d}.ccw"


class FileSink:
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
                 flush_interval: float, queue_records: int):
        self.builder = builder
        self.sink = sink
        self.batch_records = batch_records
        self.flush_interval = flush_interval
        self.queue_records = queue_records
        self.counters = {"records": 0, "dropped": 0, "unsent_batches": 0, "errors": 0}
        self._q: deque[Pending] = deque()
        self._waiting: deque[Pending] = deque()
        self._ready: list[Record] = []
        self._seq = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commcheck-sender", daemon=True)

    def start(self) -> None:
        self._send(self.builder.control(HELLO, self._next_seq(), time.time(), os.getpid()))
        self._thread.start()

    def submit(self, item: Pending) -> None:
        """Called on the training thread: O(1), never blocks."""
        if len(self._q) + len(self._waiting) >= self.queue_records:
            self.counters["dropped"] += 1
            return
        self._q.append(item)
        if len(self._q) >= self.batch_records:
            self._wake.set()

    def close(self, linger: float) -> None:
        """Deliver what is queued (waiting at most ``linger`` s for device work), say goodbye."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=linger + 1.0)
        self._drain(deadline=time.monotonic() + linger)
        self._flush()
        lost = len(self._waiting) + len(self._q)
        self.counters["dropped"] += lost
        self._send(self.builder.control(GOODBYE, self._next_seq(), time.time(), os.getpid(),
                                        counters=dict(self.counters)))
        self.sink.close(linger)

    def _next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def _send(self, env: Envelope) -> None:
        try:
            if not self.sink.send(encode(env)):
                self.counters["unsent_batches"] += 1
                self.counters["dropped"] += len(env.records) // REC_DTYPE.itemsize
        except Exception as e:  # never let the sender thread die on one bad send
            self.counters["errors"] += 1
            log.warning("commcheck: send failed: %s", e)

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


def _check_port(endpoint: str) -> None:
    """libzmq silently takes a tcp port modulo 65536; refuse instead of binding elsewhere."""
    scheme, _, rest = endpoint.partition("://")
    port = rest.rsplit(":", 1)[-1]
    if scheme == "tcp" and port != "*" and not (port.isdigit() and int(port) <= 65535):
        raise zmq.ZMQError(errno.EINVAL, f"port {port!r} is not 0-65535 or *")


class Receiver:
    """Collector side: a PULL socket bound to ``endpoint``, CURVE-guarded when given keys.

    Refused senders are reported through ``on_reject(reason, message)``; their messages
    never come out of :meth:`recv`. Messages beyond ``MAX_RECEIVE_BYTES`` make libzmq drop
    the connection before buffering them (memory bound); smaller oversized ones are received
    and rejected, counted, by the decoder.
    """

    MAX_RECEIVE_BYTES = 4 * MAX_MESSAGE_BYTES

    def __init__(self, endpoint: str, curve: ServerKeys | None = None,
                 on_reject: Reject | None = None):
        _check_port(endpoint)
        self.ctx = zmq.Context()
        self.gate: Gatekeeper | None = None
        self.poller = zmq.Poller()
        try:
            self.sock = self.ctx.socket(zmq.PULL)
            self.sock.setsockopt(zmq.RCVHWM, 10000)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.MAX_RECEIVE_BYTES)
            if curve is not None:
                self.gate = Gatekeeper(self.ctx, curve, on_reject or (lambda r, m: None))
                for s in self.gate.guard(self.sock):
                    self.poller.register(s, zmq.POLLIN)
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.poller.register(self.sock, zmq.POLLIN)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_ms: int) -> bytes | None:
        """The next message, or None after ``timeout_ms`` (or after serving only handshakes)."""
        if self.gate is None:
            return self.sock.recv(copy=True) if self.sock.poll(timeout_ms) else None
        ready = dict(self.poller.poll(timeout_ms))
        self.gate.service(ready)
        return self.sock.recv(copy=True) if self.sock in ready else None

    def close(self) -> None:
        if self.gate is not None:
            self.sock.disable_monitor()
            self.gate.close()
        self.sock.close()
        self.ctx.term()
