"""A rank starts its node's relay when none holds the run's lock: what it tells the relay
(:class:`~commcheck.wire.relay_settings.RelaySettings`, built from the rank's
configuration) and how it starts it (detached, ``python -m commcheck.relay``, handing over
the locked lock file so the lock is never free in between)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields, replace

from ..wire.relay_settings import RelaySettings, to_argv
from ..wire.ring import RingError, lock_name, log_name, open_private, try_lock
from .config import Config

log = logging.getLogger("commcheck")

_FROM_CONFIG = tuple(f.name for f in fields(RelaySettings)
                     if f.name in {c.name for c in fields(Config)})


def _absolute(path: str) -> str:
    return os.path.abspath(path) if path else ""


def relay_settings(cfg: Config, run: str, node: int, expect: int) -> RelaySettings:
    """What this rank tells its node's relay: every relay field of its configuration, paths
    made absolute; dump files only without a collector, CURVE keys only with one (the ring
    directory is set by :meth:`RingWriter.create`, which may choose another)."""
    s = replace(RelaySettings(run=run, node=node, expect=expect),
                **{name: getattr(cfg, name) for name in _FROM_CONFIG})
    keys = ("curve_dir", "curve_client_key", "curve_server_key")
    return replace(s, dump_dir=_absolute(s.dump_dir) if not s.collector else "",
                   spill_dir=_absolute(s.spill_dir),
                   **{k: _absolute(getattr(s, k)) if s.collector else "" for k in keys})


@dataclass
class RelayLaunch:
    """How this rank starts its node's relay when none holds the lock: the lock file, the
    relay's log and settings."""

    ring_dir: str
    prefix: str
    settings: RelaySettings
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started: int = 0
    _not_before: float = 0.0  # a relay that keeps dying is restarted ever more slowly
    _delay: float = 1.0
    _warned: bool = False

    @property
    def lock_path(self) -> str:
        return os.path.join(self.ring_dir, lock_name(self.prefix))

    def ensure(self) -> bool:
        """Start a relay unless one holds the lock; True if this call started one. The
        locked descriptor is handed to the relay, so the lock is never free in between."""
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None  # reaped
        now = time.monotonic()
        if now < self._not_before:
            return False
        fd = try_lock(self.lock_path)
        if fd is None:
            return False
        # started again within 30 s of the last start: wait twice as long before the next
        self._delay = min(60.0, self._delay * 2) if now - self._not_before < 30 else 1.0
        self._not_before = now + self._delay
        try:
            logfd = open_private(os.path.join(self.ring_dir, log_name(self.prefix)),
                                 os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                argv = to_argv(replace(self.settings, lock_fd=fd))
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "commcheck.relay", *argv],
                    pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=logfd, stderr=logfd,
                    start_new_session=True, close_fds=True)
            finally:
                os.close(logfd)
            self.started += 1
            return True
        finally:
            os.close(fd)

    def watch(self, ring_path: str) -> None:
        """Once a second from the resolver thread: a relay is there, or one is started;
        a failure to start one is said once."""
        try:
            if self.ensure() and self.started > 1:
                log.warning("commcheck: no relay was running for %s; started another",
                            ring_path)
        except Exception as e:
            if not self._warned:
                self._warned = True
                why = str(e) if isinstance(e, RingError | OSError) else repr(e)
                log.warning("commcheck: cannot start the relay: %s; records stay in %s",
                            why, ring_path)


def say_refused(settings: RelaySettings | None, ring_path: str) -> None:
    """The one line for a collector that refuses this job's CURVE keys (which collector,
    which key file), instead of a count of unacknowledged records at exit."""
    s = settings or RelaySettings()
    key = s.curve_client_key or (os.path.join(s.curve_dir, "client.key_secret")
                                 if s.curve_dir else "(no CURVE key)")
    log.warning("commcheck: the collector at %s refuses this job's CURVE key %s: no "
                "record is delivered (they stay in %s for `commcheck analyze`; the "
                "relay's log says why)", s.collector or "?", key, ring_path)
