"""ZeroMQ CURVE keys and the collector's gatekeeper.

Key directory layout (written by ``commcheck keygen DIR``)::

    DIR/server.key          server public key      ranks need it
    DIR/server.key_secret   server key pair, 0600  the collector only
    DIR/client.key_secret   client key pair, 0600  the ranks
    DIR/clients/*.key       client public keys the collector accepts (exactly these)

The collector answers ZAP requests itself, in its own loop (no authenticator thread), and
watches its socket's handshake events, so every refused connection attempt is counted by
reason: ``auth`` (client key not in ``clients/``) or ``auth_handshake`` (the handshake failed
before a key could be checked: a sender without CURVE keys, or with the wrong server key).
A refused sender's libzmq keeps reconnecting, so these count attempts, not senders.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_SECRET = "client.key_secret"
CLIENTS_DIR = "clients"
CLIENT_PUBLIC = f"{CLIENTS_DIR}/client.key"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"

if TYPE_CHECKING:
    from .config import Config

Reject = Callable[[str, str], None]


class SecurityError(ValueError):
    """Unusable key material; the message is one line naming the file."""


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server: bytes


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed: frozenset[bytes]


def _load(path: Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError, UnicodeDecodeError):
        raise SecurityError(f"{path}: missing or not a CURVE key file") from None
    if len(public) != 40 or (need_secret and (secret is None or len(secret) != 40)):
        raise SecurityError(f"{path}: not a valid CURVE {'secret' if need_secret else 'public'}"
                            f" key file")
    return public, secret


def keygen(directory: str | Path, force: bool = False) -> list[Path]:
    """Write a server and a client key pair; refuse to replace existing keys unless ``force``.

    Keys are created in a private temporary directory and moved into place, so a secret
    file is never readable by others, not even briefly.
    """
    d = Path(directory)
    targets = [d / n for n in (SERVER_PUBLIC, SERVER_SECRET, CLIENT_SECRET, CLIENT_PUBLIC)]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise SecurityError(f"{existing[0]} exists; pass --force to replace the keys")
    try:
        if not d.exists():
            d.mkdir(parents=True, mode=0o700)
        (d / CLIENTS_DIR).mkdir(exist_ok=True, mode=0o700)
        tmp = Path(tempfile.mkdtemp(dir=d, prefix=".keygen-"))
    except OSError as e:
        raise SecurityError(f"{d}: cannot create the key directory ({e.strerror})") from None
    try:
        server_pub, server_sec = zmq.auth.create_certificates(tmp, "server")
        client_pub, client_sec = zmq.auth.create_certificates(tmp, "client")
        for src, mode, dst in ((server_pub, 0o644, targets[0]), (server_sec, 0o600, targets[1]),
                               (client_sec, 0o600, targets[2]), (client_pub, 0o644, targets[3])):
            os.chmod(src, mode)
            os.replace(src, dst)
    except OSError as e:
        raise SecurityError(f"{d}: cannot write keys ({e.strerror})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return targets


def server_keys(directory: str | Path) -> ServerKeys:
    """The collector's key pair and the client keys it accepts."""
    d = Path(directory)
    if not d.is_dir():
        raise SecurityError(f"{d}: not a key directory (create one with commcheck keygen)")
    public, secret = _load(d / SERVER_SECRET, need_secret=True)
    clients = d / CLIENTS_DIR
    allowed = {_load(p, need_secret=False)[0] for p in sorted(clients.glob("*.key"))}
    if not allowed:
        raise SecurityError(f"{clients}: no client public keys (*.key) to accept")
    assert secret is not None
    return ServerKeys(public, secret, frozenset(allowed))


def client_keys(cfg: Config) -> ClientKeys | None:
    """A rank's keys: explicit paths win over the files of ``curve_dir``; None: no CURVE."""
    if not (cfg.curve_dir or cfg.curve_client_key or cfg.curve_server_key):
        return None
    d = Path(cfg.curve_dir) if cfg.curve_dir else None
    client = Path(cfg.curve_client_key) if cfg.curve_client_key else \
        (d / CLIENT_SECRET if d else None)
    server = Path(cfg.curve_server_key) if cfg.curve_server_key else \
        (d / SERVER_PUBLIC if d else None)
    if client is None or server is None:
        raise SecurityError("CURVE needs both a client secret key and the server public key "
                            "(set curve_dir, or curve_client_key and curve_server_key)")
    public, secret = _load(client, need_secret=True)
    assert secret is not None
    return ClientKeys(public, secret, _load(server, need_secret=False)[0])


def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.curve_serverkey = keys.server


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
    if curve_dir or is_loopback(bind):
        return None
    return (f"commcheck collect: warning: {bind} is reachable from other hosts and "
            f"unauthenticated (use --curve-dir; see README 'Running it securely')")


_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


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
    return f"refused a connection: {why}"


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

    def guard(self, sock: zmq.Socket) -> list[zmq.Socket]:
        """Make ``sock`` a CURVE server; return the sockets the owner's poller must watch."""
        sock.curve_server = True
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        sock.zap_domain = b"commcheck"
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
        self.monitor.linger = 0
        return [self.zap, self.monitor]

    def service(self, ready: dict[zmq.Socket, int]) -> None:
        """Answer pending ZAP requests and count failed handshakes (never blocks)."""
        while self.zap in ready and self.zap.poll(0):
            self._answer(self.zap.recv_multipart())
        while self.monitor is not None and self.monitor in ready and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] & _HANDSHAKE_FAILURES:
                self.on_reject("auth_handshake", _handshake_failure(event))

    def _answer(self, msg: list[bytes]) -> None:
        msg = msg + [b""] * (7 - len(msg))  # a REP socket must answer even a short request
        request_id, address, mechanism, key = msg[1], msg[3], msg[5], msg[6]
        public = z85.encode(key) if len(key) == 32 else b""
        ok = msg[0] == b"1.0" and mechanism == b"CURVE" and public in self.keys.allowed
        self.zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                 b"OK" if ok else b"client key not allowed", b"", b""])
        if not ok:
            self.on_reject("auth", f"refused client key {public.decode(errors='replace')} "
                                   f"from {address.decode(errors='replace')}")

    def close(self) -> None:
        self.zap.close()
        if self.monitor is not None:
            self.monitor.close()
