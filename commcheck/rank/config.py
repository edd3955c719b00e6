"""The one configuration of the rank side: kwargs > env (COMMCHECK_*) > JSON file > defaults.

The JSON file is named by ``COMMCHECK_CONFIG`` (or the ``config`` kwarg) and holds the same
keys as :class:`Config`. Every value is validated here, once; a bad one raises
:class:`ConfigError` with a single line that names the key, the value and where it came from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..wire.keys import ClientKeys, SecurityError, client_keys
from ..wire.relay_settings import RELAY_DEFAULTS as _RELAY

ENV_PREFIX = "COMMCHECK_"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    """The rank's settings; those it passes to its node's relay keep the relay's names and
    defaults (:class:`~commcheck.wire.relay_settings.RelaySettings`)."""

    collector: str = ""  # ZeroMQ endpoint of `commcheck collect`, e.g. tcp://head:5555
    dump_dir: str = ""  # no collector: write per-rank wire files here
    run_id: str = ""  # default: TORCHELASTIC_RUN_ID, else MASTER_ADDR:MASTER_PORT
    host: str = ""  # host label in reports; default: the hostname
    disable: bool = False
    hash: bool = True  # fingerprint outputs (and inputs)
    summary: bool = True  # float64 sum, abs-max, NaN/Inf counts
    hash_reduce_inputs: bool = False  # also hash inputs of reductions (diagnostic only)
    callsite: bool = True
    hotpath: bool = True  # the one-pass path for plain calls (rank/hotpath.py); 0: general
    batch_records: int = _RELAY.batch_records  # records per wire batch (cut by the relay)
    flush_interval: float = _RELAY.flush_interval  # seconds a partial batch may wait (in the relay)
    queue_records: int = 65536  # bound on records waiting for their device fingerprints
    linger: float = _RELAY.linger  # seconds to deliver what is queued at exit
    ring_dir: str = ""  # the rank's ring file and the relay's lock: default /dev/shm
    ring_bytes: int = 8 << 20  # the ring: records kept until acknowledged; beyond it, drop
    buffer_bytes: int = _RELAY.buffer_bytes  # batches the relay keeps per rank awaiting acks
    spill_dir: str = ""  # beyond buffer_bytes: the relay spills batches here (else waits)
    spill_bytes: int = _RELAY.spill_bytes  # bound on one rank's spill file; beyond it, wait
    ack_timeout: float = _RELAY.ack_timeout  # seconds before an unacked batch is resent (backs off)
    ddp: bool = True  # watch every DDP model built after patch(); 0: only commcheck.watch()
    inject: str = ""  # fault injection spec, see commcheck.rank.inject
    curve_dir: str = ""  # CURVE keys from `commcheck keygen`: client.key_secret, server.key
    curve_client_key: str = ""  # explicit client secret key file (overrides curve_dir's)
    curve_server_key: str = ""  # explicit server public key file (overrides curve_dir's)
    straggler: str = ""  # the collector's straggler rules (read by `commcheck collect`; the
    # ranks ignore it), see docs/stragglers.md

    @property
    def enabled_output(self) -> bool:
        return bool(self.collector or self.dump_dir)

    def client_keys(self) -> ClientKeys | None:
        """The rank's CURVE keys; None: no CURVE. Raises SecurityError on unusable files."""
        return client_keys(self.curve_dir, self.curve_client_key, self.curve_server_key)


_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off", ""}


def _coerce(name: str, value: Any, kind: type, source: str) -> Any:
    bad = ConfigError(f"commcheck config: {name}={value!r} from {source} is not a valid "
                      f"{kind.__name__}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOL_TRUE | _BOOL_FALSE:
            return value.strip().lower() in _BOOL_TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise bad
    if kind in (int, float):
        if isinstance(value, bool):
            raise bad
        try:
            v = kind(value)
        except (TypeError, ValueError):
            raise bad from None
        if kind is int and isinstance(value, float) and value != v:
            raise bad
        if v < 0:
            raise ConfigError(f"commcheck config: {name}={value!r} from {source} must not be "
                              f"negative")
        return v
    if not isinstance(value, str):
        raise bad
    return value


_TYPES = {"str": str, "bool": bool, "int": int, "float": float}


def _field_types() -> dict[str, type]:
    return {f.name: _TYPES[str(f.type)] for f in fields(Config)}


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"commcheck config: file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"commcheck config: cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"commcheck config: {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"commcheck config: {path} must hold a JSON object")
    return data


def load_config(env: dict[str, str] | None = None, **overrides: Any) -> Config:
    """Build the Config; ``env`` defaults to ``os.environ``."""
    env = dict(os.environ if env is None else env)
    types = _field_types()
    values: dict[str, Any] = {}

    path = overrides.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    layers: list[tuple[str, dict[str, Any]]] = []
    if path:
        layers.append((str(path), _read_file(str(path))))
    layers.append(("environment", {k[len(ENV_PREFIX):].lower(): v for k, v in env.items()
                                   if k.startswith(ENV_PREFIX) and k != ENV_PREFIX + "CONFIG"}))
    layers.append(("patch() arguments", overrides))
    for source, layer in layers:
        for key, value in layer.items():
            if key not in types:
                if source == "environment":
                    continue  # foreign COMMCHECK_* variables are not ours to reject
                raise ConfigError(f"commcheck config: unknown key {key!r} in {source}")
            values[key] = _coerce(key, value, types[key], source)
    cfg = replace(Config(), **values)
    if cfg.batch_records < 1 or cfg.queue_records < cfg.batch_records:
        raise ConfigError("commcheck config: need 1 <= batch_records <= queue_records")
    _check_keys(cfg)
    return cfg


def _check_keys(cfg: Config) -> None:
    try:
        cfg.client_keys()
    except SecurityError as e:
        raise ConfigError(f"commcheck config: {e}") from None
