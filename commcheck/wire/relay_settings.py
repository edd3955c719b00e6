"""The relay's settings: the contract between a rank (which starts its node's relay) and
the relay, declared once (docs/relay-settings.md).

Each field is one command-line flag of ``commcheck relay`` (``ring_dir`` ↔ ``--ring-dir``);
:func:`to_argv` writes a settings record as those flags, and the relay's command line
(``relay/main.py``) is generated from the same fields, so what a rank sends and what the
relay reads cannot drift apart. A field's ``env`` is the variable the relay falls back to
when the flag is absent (a relay started by hand in a job's environment); a rank always
passes every flag, so its own configuration wins over the environment.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any


def _opt(default: Any, help: str = "", env: str = "", hidden: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "env": env, "hidden": hidden})


@dataclass(frozen=True)
class RelaySettings:
    run: str = _opt("", "run id, as the ranks resolve it", "COMMCHECK_RUN_ID")
    node: int = _opt(-1, "node rank (torchrun's GROUP_RANK)", "GROUP_RANK")
    expect: int = _opt(1, "ranks on this node", "LOCAL_WORLD_SIZE")
    ring_dir: str = _opt("", "folder of the rings and the relay's lock (default /dev/shm)",
                         "COMMCHECK_RING_DIR")
    collector: str = _opt("", "ZeroMQ endpoint of `commcheck collect`", "COMMCHECK_COLLECTOR")
    dump_dir: str = _opt("", "no collector: write per-rank wire files here",
                         "COMMCHECK_DUMP_DIR")
    spill_dir: str = _opt("", "beyond buffer_bytes: spill batches here (else wait)",
                          "COMMCHECK_SPILL_DIR")
    spill_bytes: int = _opt(256 << 20, "bound on one rank's spill file",
                            "COMMCHECK_SPILL_BYTES")
    buffer_bytes: int = _opt(4 << 20, "encoded batches kept per rank awaiting acks",
                             "COMMCHECK_BUFFER_BYTES")
    ack_timeout: float = _opt(2.0, "seconds before an unacknowledged batch is resent",
                              "COMMCHECK_ACK_TIMEOUT")
    batch_records: int = _opt(512, "records per wire batch", "COMMCHECK_BATCH_RECORDS")
    flush_interval: float = _opt(0.05, "seconds a partial batch may wait",
                                 "COMMCHECK_FLUSH_INTERVAL")
    linger: float = _opt(5.0, "seconds to wait for acknowledgements once the ranks are done",
                         "COMMCHECK_LINGER")
    curve_dir: str = _opt("", "CURVE keys from `commcheck keygen`", "COMMCHECK_CURVE_DIR")
    curve_client_key: str = _opt("", "client secret key file (overrides curve_dir's)",
                                 "COMMCHECK_CURVE_CLIENT_KEY")
    curve_server_key: str = _opt("", "server public key file (overrides curve_dir's)",
                                 "COMMCHECK_CURVE_SERVER_KEY")
    lock_fd: int = _opt(-1, "the run's lock, locked, handed over by the starting rank",
                        hidden=True)
    log: str = _opt("", "log to this file instead of stderr; 'auto': the relay's log next "
                        "to the rings (removed when the relay exits with everything "
                        "delivered)")
    ready_file: str = _opt("", "write the relay's pid here once it holds the run's lock (or "
                               "found another relay holding it)")
    idle_exit: float = _opt(60.0, "exit after this many seconds without a live ring, even if "
                                  "fewer ranks than expected came")


RELAY_DEFAULTS = RelaySettings()  # the defaults, for the rank's configuration to reuse


def flag(f: Field) -> str:
    """A field's command-line flag: ``ring_dir`` ↔ ``--ring-dir``."""
    return "--" + f.name.replace("_", "-")


def to_argv(s: RelaySettings) -> list[str]:
    """Every field as ``--flag=value`` (empty values too: the sender's, not the receiver's
    environment, decide); :func:`repr` keeps a float exact."""
    out = []
    for f in fields(s):
        value = getattr(s, f.name)
        out.append(f"{flag(f)}={value!r}" if isinstance(value, float) else f"{flag(f)}={value}")
    return out

