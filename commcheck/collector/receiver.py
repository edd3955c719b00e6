"""The collector's socket: receives ranks' messages, answers acks, guards CURVE.
"""

from __future__ import annotations

import contextlib
import errno

import zmq

from ..wire import MAX_MESSAGE_BYTES
from ..wire.keys import ServerKeys
from .gate import Gatekeeper, Reject


def _check_port(endpoint: str) -> None:
    """libzmq silently takes a tcp port modulo 65536; refuse instead of binding elsewhere."""
    scheme, _, rest = endpoint.partition("://")
    port = rest.rsplit(":", 1)[-1]
    if scheme == "tcp" and port != "*" and not (port.isdigit() and int(port) <= 65535):
        raise zmq.ZMQError(errno.EINVAL, f"port {port!r} is not 0-65535 or *")


class Receiver:
    """Collector side: a socket bound to ``endpoint``, CURVE-guarded when given keys.

    ``acked`` (the collector) makes it a ROUTER that ranks' DEALERs talk to:
    :meth:`recv_from` returns the sender's identity with each message and :meth:`ack`
    answers it. Without, a PULL for PUSH senders (benchmarks). Refused senders are
    reported through ``on_reject(reason, message, who)``; their messages never come out.
    Messages beyond ``MAX_RECEIVE_BYTES`` make libzmq drop the connection before buffering
    them (memory bound); smaller oversized ones are received and rejected, counted, by the
    decoder.
    """

    MAX_RECEIVE_BYTES = 4 * MAX_MESSAGE_BYTES

    def __init__(self, endpoint: str, curve: ServerKeys | None = None,
                 on_reject: Reject | None = None, acked: bool = False):
        _check_port(endpoint)
        self.ctx = zmq.Context()
        self.gate: Gatekeeper | None = None
        self.poller = zmq.Poller()
        self.acked = acked
        try:
            self.sock = self.ctx.socket(zmq.ROUTER if acked else zmq.PULL)
            self.sock.setsockopt(zmq.RCVHWM, 10000)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.MAX_RECEIVE_BYTES)
            if acked:
                # No ZMTP heartbeats here: while this queue is full libzmq stops reading the
                # socket, a heartbeat timeout would then drop a healthy sender's connection
                # and the messages queued for it. Dead peers are reaped by TCP keepalive.
                self.sock.setsockopt(zmq.SNDHWM, 10000)
                self.sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
                self.sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
                self.sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
                self.sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 6)
            if curve is not None:
                self.gate = Gatekeeper(self.ctx, curve, on_reject or (lambda r, m, w: None))
                for s in self.gate.guard(self.sock):
                    self.poller.register(s, zmq.POLLIN)
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.poller.register(self.sock, zmq.POLLIN)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _poll(self, timeout_ms: int) -> bool:
        if self.gate is None:
            return bool(self.sock.poll(timeout_ms))
        ready = dict(self.poller.poll(timeout_ms))
        self.gate.service(ready)
        return self.sock in ready

    def recv_from(self, timeout_ms: int) -> tuple[bytes, bytes] | None:
        """(sender identity, message), or None after ``timeout_ms`` (or after serving only
        handshakes). A multi-part message arrives as ``b""`` (rejected as malformed)."""
        if timeout_ms == 0 and self.gate is None:  # draining a burst: no poller per message
            try:
                return self._recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
        if not self._poll(timeout_ms):
            return None
        return self._recv(0)

    def _recv(self, flags: int) -> tuple[bytes, bytes]:
        if not self.acked:
            return b"", self.sock.recv(flags, copy=True)
        frames = self.sock.recv_multipart(flags, copy=True)
        return frames[0], frames[1] if len(frames) == 2 else b""

    def recv(self, timeout_ms: int) -> bytes | None:
        """The next message, or None after ``timeout_ms`` (or after serving only handshakes)."""
        got = self.recv_from(timeout_ms)
        return None if got is None else got[1]

    def ack(self, identity: bytes, payload: bytes) -> None:
        """Answer a sender; dropped, never blocking, if it is gone or not reading."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([identity, payload], zmq.NOBLOCK)

    def close(self, linger: float = 0.0) -> None:
        if self.gate is not None:
            self.sock.disable_monitor()
            self.gate.close()
        self.sock.close(linger=int(linger * 1000))
        self.ctx.term()
