"""The collector's gatekeeper: CURVE server side, ZAP answers, refused-handshake counting.

The collector answers ZAP requests itself, in its own loop (no authenticator thread), and
watches its socket's handshake events, so every refused connection attempt is counted by
reason: ``auth`` (client key not in ``clients/``) or ``auth_handshake`` (the handshake failed
before a key could be checked: a sender without CURVE keys, or with the wrong server key).
A refused sender's libzmq keeps reconnecting, so these count attempts, not senders.
Both name the peer's address: ZAP hands it over; a failed handshake is reported when its
connection closes, with the address of that connection (the monitor's accept event
carries the descriptor, the failure event does not).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from ..wire.keys import ServerKeys

ZAP_ENDPOINT = "inproc://zeromq.zap.01"

Reject = Callable[[str, str, str], None]  # (reason, message, who: the sender named)


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` is reachable from this host only (ipc/inproc, 127/8, ::1)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_bind_warning(bind: str, curve_dir: str) -> str | None:
    """The one line ``collect`` says when it runs open (no CURVE keys): on loopback any
    local process can send as the job's ranks, elsewhere any host can."""
    if curve_dir:
        return None
    if is_loopback(bind):
        return (f"commcheck collect: warning: {bind} runs open: any local process can send "
                f"as the job's ranks (use --curve-dir; see docs/security.md)")
    return (f"commcheck collect: warning: {bind} is reachable from other hosts and "
            f"unauthenticated (use --curve-dir; see README 'Running it securely')")


_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_WATCHED = _HANDSHAKE_FAILURES | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
MAX_PEERS = 4096  # accepted connections whose address is remembered


def peer_of(fd: int) -> str:
    """``host:port`` of the other end of socket ``fd`` (libzmq's: only looked at)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            peer = s.getpeername()
    except OSError:
        return "an unknown address"
    if isinstance(peer, tuple):
        host = peer[0]
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return f"ipc {peer or '(unnamed)'}"


def host_of(peer: str) -> str:
    """``peer`` without its port: a refused sender reconnects from a new port each time."""
    host, colon, port = peer.rpartition(":")
    return host if colon and port.isdigit() else peer


def _handshake_failure(event: dict) -> str:
    code = int(event["value"])
    if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        why = "the sender left during the handshake (no CURVE keys?)"
    elif code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        why = "the sender has no CURVE keys"
    elif code == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        why = "the sender holds the wrong server key"
    else:
        why = f"ZMTP error {code:#x}"
    return why


class Gatekeeper:
    """CURVE server side of one socket: ZAP answers and handshake-failure counting.

    Must be created before the guarded socket binds: libzmq accepts every client key when
    no ZAP handler listens at handshake time.
    """

    def __init__(self, ctx: zmq.Context, keys: ServerKeys, on_reject: Reject):
        self.keys = keys
        self.on_reject = on_reject
        self.zap = ctx.socket(zmq.REP)
        self.zap.linger = 0
        self.zap.bind(ZAP_ENDPOINT)
        self.monitor: zmq.Socket | None = None
        self._peers: dict[int, str] = {}  # accepted descriptor -> peer address
        self._failed: deque[str] = deque()  # failed handshakes waiting for their close

    def guard(self, sock: zmq.Socket) -> list[zmq.Socket]:
        """Make ``sock`` a CURVE server; return the sockets the owner's poller must watch."""
        sock.curve_server = True
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        sock.zap_domain = b"commcheck"
        self.monitor = sock.get_monitor_socket(_WATCHED)
        self.monitor.linger = 0
        return [self.zap, self.monitor]

    def service(self, ready: dict[zmq.Socket, int]) -> None:
        """Answer pending ZAP requests and count failed handshakes (never blocks)."""
        while self.zap in ready and self.zap.poll(0):
            self._answer(self.zap.recv_multipart())
        while self.monitor is not None and self.monitor in ready and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                if len(self._peers) >= MAX_PEERS:
                    self._peers.clear()
                self._peers[int(event["value"])] = peer_of(int(event["value"]))
            elif kind & _HANDSHAKE_FAILURES:
                self._failed.append(_handshake_failure(event))
            elif kind == zmq.EVENT_DISCONNECTED:
                peer = self._peers.pop(int(event["value"]), "an unknown address")
                if self._failed:
                    why = self._failed.popleft()
                    self.on_reject("auth_handshake",
                                   f"refused a connection: {why} from {peer}",
                                   f"{host_of(peer)} ({why})")

    def _answer(self, msg: list[bytes]) -> None:
        msg = msg + [b""] * (7 - len(msg))  # a REP socket must answer even a short request
        request_id, address, mechanism, key = msg[1], msg[3], msg[5], msg[6]
        public = z85.encode(key) if len(key) == 32 else b""
        ok = msg[0] == b"1.0" and mechanism == b"CURVE" and public in self.keys.allowed
        self.zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                 b"OK" if ok else b"client key not allowed", b"", b""])
        if not ok:
            who = f"client key {public.decode(errors='replace')} from " \
                  f"{address.decode(errors='replace')}"
            self.on_reject("auth", f"refused {who}", who)

    def close(self) -> None:
        while self._failed:
            why = self._failed.popleft()
            self.on_reject("auth_handshake", f"refused a connection: {why}",
                           f"an unknown address ({why})")
        self.zap.close()
        if self.monitor is not None:
            self.monitor.close()
