"""ZeroMQ CURVE key files: the layout both sides read, and ``commcheck keygen``.

Key directory layout (written by ``commcheck keygen DIR``)::

    DIR/server.key          server public key      ranks need it
    DIR/server.key_secret   server key pair, 0600  the collector only
    DIR/client.key_secret   client key pair, 0600  the ranks
    DIR/clients/*.key       client public keys the collector accepts (exactly these)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_SECRET = "client.key_secret"
CLIENTS_DIR = "clients"
CLIENT_PUBLIC = f"{CLIENTS_DIR}/client.key"


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


def client_keys(curve_dir: str, client_key: str = "", server_key: str = "") -> ClientKeys | None:
    """A rank's keys: explicit paths win over the files of ``curve_dir``; None: no CURVE."""
    if not (curve_dir or client_key or server_key):
        return None
    d = Path(curve_dir) if curve_dir else None
    client = Path(client_key) if client_key else (d / CLIENT_SECRET if d else None)
    server = Path(server_key) if server_key else (d / SERVER_PUBLIC if d else None)
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
