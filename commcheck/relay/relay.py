"""The relay: one process per node and run that tails the rings of the node's ranks and
ships their records (see the package docstring).

Single-threaded: one loop finds rings, reads them, sends, takes acks, watches the ranks'
processes and reports what it sees (``status`` messages). It holds the run's lock file
(``flock``) while it serves, so there is one relay per (run, destination, node); the lock
is handed over by whoever started it (a rank passes its locked descriptor) or taken here.

It exits once every rank it expects (``--expect``, the node's LOCAL_WORLD_SIZE) said
goodbye or died and everything is acknowledged; with nothing acknowledged it waits at most
``--linger`` seconds, then leaves what is undelivered in the rings and spill files for
``commcheck analyze``, and says so in its log. Before it goes it lets the lock go and looks
once more for a ring that appeared meanwhile (a rank that found the lock taken relies on
that): if there is one and it gets the lock back, it carries on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace

from ..wire import GONE, BatchBuilder, RankStatus, encode
from ..wire.keys import CLIENT_SECRET, SERVER_PUBLIC, client_keys
from ..wire.private import announce
from ..wire.relay_settings import RelaySettings
from ..wire.ring import (
    R_BEAT,
    R_HELD,
    R_PID,
    RING_SUFFIX,
    STATE_LEFT,
    STATE_RUNNING,
    Ring,
    RingError,
    blocked,
    default_ring_dir,
    destination,
    lock_name,
    log_name,
    proc_stat,
    ring_prefix,
    try_lock,
    unlock,
)
from .channel import Channel
from .link import Outages, ZmqLink

log = logging.getLogger("commcheck.relay")

SCAN_INTERVAL = 0.2  # seconds between looks for new rings
WATCH_INTERVAL = 0.5  # seconds between looks at the ranks' processes
STATUS_INTERVAL = 1.0  # seconds between status messages (and at every change)
POLL_MS = 10  # the loop's wait for acks when nothing is to do


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += 1


class Relay:
    def __init__(self, opts: RelaySettings):
        self.o = opts
        self.dest = destination(opts.collector, opts.dump_dir)
        self.prefix = ring_prefix(os.getuid(), opts.run, self.dest, opts.node)
        self.ring_dir = os.path.abspath(opts.ring_dir or default_ring_dir())
        refused = blocked(self.ring_dir, self.prefix)  # the ranks' check: they go elsewhere
        if refused:
            raise RingError(f"{refused}; not serving {self.ring_dir} (the ranks record into "
                            f"private folders of their own)")
        self.settings = replace(
            opts, spill_dir=os.path.abspath(opts.spill_dir) if opts.spill_dir else "",
            dump_dir=os.path.abspath(opts.dump_dir) if opts.dump_dir else "")
        self.link: ZmqLink | None = None
        self.channels: dict[str, Channel] = {}
        self.skip: dict[str, int] = {}  # rings refused, or served to the end (path: inode)
        self.served = 0
        self.lock_fd = -1
        self._handed_fd = opts.lock_fd  # the lock a rank handed over, until taken
        self.stop_signal = 0
        self.no_more_ranks = False  # SIGUSR1: the node's ranks have all ended
        self.statuses: dict[int, RankStatus] = {}  # by pid, closed channels' included
        self._status_key: tuple = ()
        self._status_seq = 0
        self._status_builder: BatchBuilder | None = None
        self._said_refused = ""
        # no ack for this long while messages wait: an outage (in the report)
        self.outages = Outages(max(5.0, 2 * opts.ack_timeout))
        self._flagged = 0  # rings told about a refusal (``served`` then)
        self.warnings = _Warnings()
        log.addHandler(self.warnings)
        logging.getLogger("commcheck").addHandler(self.warnings)

    # -- the lock --------------------------------------------------------------------------

    @property
    def lock_path(self) -> str:
        return os.path.join(self.ring_dir, lock_name(self.prefix))

    def acquire(self) -> bool:
        """Take the run's lock (or keep the one handed over); False: another relay has it."""
        if self._handed_fd >= 0 and self.lock_fd < 0:
            self.lock_fd, self._handed_fd = self._handed_fd, -1
            return True
        fd = try_lock(self.lock_path)
        if fd is None:
            return False
        self.lock_fd = fd
        return True

    def release(self) -> None:
        """Let the lock go (its file is removed: /dev/shm keeps nothing of a finished run)."""
        if self.lock_fd >= 0:
            unlock(self.lock_path, self.lock_fd)
            self.lock_fd = -1

    # -- rings -----------------------------------------------------------------------------

    def _rings(self) -> dict[str, int]:
        """This relay's ring files in the ring directory: path -> inode."""
        head = f"{self.prefix}-r"
        try:
            with os.scandir(self.ring_dir) as it:
                return {e.path: e.inode() for e in it
                        if e.name.startswith(head) and e.name.endswith(RING_SUFFIX)}
        except OSError as e:
            log.warning("cannot list %s: %s", self.ring_dir, e)
            return {}

    def _skipped(self, path: str, inode: int) -> bool:
        return self.skip.get(path) == inode

    def scan(self) -> None:
        found = self._rings()
        self.skip = {p: i for p, i in self.skip.items() if found.get(p) == i}
        for path, inode in sorted(found.items()):
            if path in self.channels or self._skipped(path, inode):
                continue
            try:
                ring = Ring.open(path)  # refuses what is not ours, or not 0600
            except (OSError, RingError) as e:
                if not isinstance(e, FileNotFoundError):
                    log.warning("not serving %s: %s", path, e)
                self.skip[path] = inode
                continue
            inode = os.fstat(ring.fd).st_ino
            ident = ring.identity
            if (ident.run, ident.dest, ident.node) != (self.o.run, self.dest, self.o.node):
                log.warning("not serving %s: it belongs to run %r, %r, node %d", path,
                            ident.run, ident.dest, ident.node)
                ring.close()
                self.skip[path] = inode
                continue
            try:
                ch = Channel(ring, self.settings, self.link)
            except Exception as e:
                log.warning("not serving %s: %r", path, e)
                ring.close()
                self.skip[path] = inode
                continue
            ch.owner.look()
            self.channels[path] = ch
            self.served += 1
            log.info("serving rank %d (pid %d) from %s, seq %d", ident.rank, ident.pid, path,
                     ch.next_seq)

    def _fresh_rings(self) -> bool:
        """A ring of a live rank that this relay does not serve (appeared meanwhile)?"""
        for path, inode in self._rings().items():
            if path in self.channels or self._skipped(path, inode):
                continue
            try:
                ring = Ring.open(path, writable=False)
            except (OSError, RingError):
                continue
            try:
                if ring.state() == STATE_RUNNING and proc_stat(ring.identity.pid) is not None:
                    return True
            finally:
                ring.close()
        return False

    # -- the loop --------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _on_no_more_ranks(self, signum: int, frame: object) -> None:
        """SIGUSR1, from ``commcheck run`` once torchrun has exited: a rank of the node
        that made no ring (it died at start-up) never will, so the relay ends as soon as
        the rings it serves are delivered instead of waiting for ``--expect`` ranks."""
        self.no_more_ranks = True

    @property
    def log_path(self) -> str:
        return os.path.join(self.ring_dir, log_name(self.prefix))

    def run(self, ready_file: str = "") -> int:
        got = self.acquire()
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # before it says it is ready
            signal.signal(s, self._on_signal)
        signal.signal(signal.SIGUSR1, self._on_no_more_ranks)
        if ready_file:
            announce(ready_file, str(os.getpid() if got else 0))
        if not got:
            log.info("another relay serves %s; exiting", self.prefix)
            return 0
        if self.o.collector:
            curve = client_keys(self.o.curve_dir, self.o.curve_client_key,
                                self.o.curve_server_key)
            self.link = ZmqLink(self.o.collector, hwm=max(64, 16 * self.o.expect),
                                curve=curve)
        log.info("relay for run %r node %d: %s, rings in %s (expecting %d)", self.o.run,
                 self.o.node, self.dest, self.ring_dir, self.o.expect)
        try:
            with quiet_gc():
                self._loop()
        finally:
            self._close()
        return 0

    def _loop(self) -> None:
        start = time.monotonic()
        next_scan = next_watch = next_status = 0.0
        live_since = start  # last time a ring was unfinished (or the start)
        all_done_at: float | None = None
        signalled_at: float | None = None
        while True:
            now = time.monotonic()
            if now >= next_scan:
                served = self.served
                self.scan()
                next_scan = now + SCAN_INTERVAL
                if self.served != served:
                    all_done_at = None  # a new ring: its records get the whole linger
            if now >= next_watch:
                for ch in self.channels.values():
                    ch.owner.look()
                    ch.ring.set_word(R_PID, os.getpid())
                    ch.ring.set_when(R_BEAT, time.time())
                    ch.ring.set_word(R_HELD, ch.outbox.bytes if ch.outbox is not None else 0)
                next_watch = now + WATCH_INTERVAL
            busy = 0
            for ch in self.channels.values():
                busy += ch.poll(now, ch.owner.gone)
            if self.link is not None:
                self._watch_link()
                acks = self.link.acks() if self.link.wait(0 if busy else POLL_MS) else []
                self._dispatch(acks)
                self.outages.tick(now, bool(acks), any(
                    ch.outbox is not None and (len(ch.outbox) or ch.spill is not None and
                                               ch.spill.pending)
                    for ch in self.channels.values()))
                for ch in self.channels.values():
                    ch.pump(now)
                if now >= next_status or self._status_changed():
                    self._send_status()
                    next_status = now + STATUS_INTERVAL
            elif not busy:
                time.sleep(POLL_MS / 1000)
            self._retire()
            if self.stop_signal and signalled_at is None:
                signalled_at = now
                log.info("signal %d: delivering for at most %g s", self.stop_signal,
                         self.o.linger)
            unfinished = [ch for ch in self.channels.values() if not ch.finished(ch.owner.gone)]
            if unfinished:
                live_since, all_done_at = now, None
            elif not self.channels:
                all_done_at = None  # the linger counts from when served rings are all read
            elif all_done_at is None:
                all_done_at = now
            if signalled_at is not None:
                if not self.channels or now - signalled_at >= self.o.linger:
                    return
                continue
            expected = self.served if self.no_more_ranks else self.o.expect
            if unfinished or not (self.served >= expected or
                                  now - live_since >= self.o.idle_exit):
                continue
            if self.channels and now - all_done_at < self.o.linger:
                continue  # everything read, not everything acknowledged: wait a little
            self.release()  # a rank that found the lock taken counts on this look
            if self._fresh_rings() and self.acquire():
                log.info("a new ring appeared; serving on")
                all_done_at = None
                continue
            return

    def _watch_link(self) -> None:
        """The link's events: a refusal is said once (one line naming the collector and
        the key files) and flagged in every ring, so each rank says it too."""
        link = self.link
        was = link.refused
        for why in link.watch():
            if why != self._said_refused:
                self._said_refused = why
                log.warning("the collector at %s %s: nothing is delivered (client key %s, "
                            "server key %s)", link.endpoint, why, *self.key_files())
        if link.refused != was or self.served != self._flagged:
            self._flagged = self.served
            for ch in self.channels.values():
                ch.refused(bool(link.refused))

    def key_files(self) -> tuple[str, str]:
        o = self.o
        client = o.curve_client_key or (os.path.join(o.curve_dir, CLIENT_SECRET)
                                        if o.curve_dir else "(none)")
        server = o.curve_server_key or (os.path.join(o.curve_dir, SERVER_PUBLIC)
                                        if o.curve_dir else "(none)")
        return client, server

    def _dispatch(self, acks: list[tuple[int, int]]) -> None:
        if not acks:
            return
        by_pid: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for pid, seq in acks:
            by_pid[pid].append((pid, seq))
        for ch in self.channels.values():
            names = by_pid.get(ch.pid)
            if names:
                ch.acked(names)

    def _retire(self) -> None:
        """Stop serving rings that are finished and delivered: once the rank removed its
        own (it does when it saw everything acknowledged), or once the rank is gone (then
        the ring is removed here: a rank killed while it waited for the last ack leaves
        nothing behind either)."""
        for path, ch in list(self.channels.items()):
            gone = ch.owner.gone
            if not (ch.finished(gone) and ch.delivered()):
                continue
            vanished = not ch.ring.is_at(path)
            left = gone or ch.ring.state() == STATE_LEFT  # nobody else will remove it
            if not (left or vanished):
                continue
            if self.link is not None:
                self.statuses[ch.pid] = ch.status(time.monotonic(),
                                                  *self.outages.total(time.monotonic()))
            inode = os.fstat(ch.ring.fd).st_ino
            ch.close(remove=left and not vanished)
            del self.channels[path]
            if not vanished:
                self.skip[path] = inode
            log.info("rank %d (pid %d): everything delivered%s", ch.ident.rank, ch.pid,
                     " (the rank is gone)" if gone else "")

    # -- status ----------------------------------------------------------------------------

    def _status_changed(self) -> bool:
        key = tuple(sorted((ch.pid, ch.owner.last.state, ch.finished(ch.owner.gone))
                           for ch in self.channels.values()))
        if key != self._status_key:
            self._status_key = key
            return True
        return False

    def _send_status(self) -> None:
        now = time.monotonic()
        unreachable, outages = self.outages.total(now)
        for ch in self.channels.values():
            self.statuses[ch.pid] = ch.status(now, unreachable, outages)
            if self._status_builder is None:
                i = ch.ident
                self._status_builder = BatchBuilder(i.run, i.rank, i.host, i.world, i.node)
        if not self.statuses or self._status_builder is None:
            return
        b = self._status_builder
        b.rank = min(s.rank for s in self.statuses.values())
        env = b.status(self._status_seq, time.time(), os.getpid(),
                       sorted(self.statuses.values(), key=lambda s: (s.rank, s.pid)))
        self._status_seq += 1
        with contextlib.suppress(Exception):
            self.link.send(encode(env))

    # -- the end ---------------------------------------------------------------------------

    def _close(self) -> None:
        """Exit: what the collector did not acknowledge goes to the spill files (when there
        are), and stays in the rings otherwise; either is logged with its counts."""
        for ch in self.channels.values():
            if not ch.delivered() and ch.finished(ch.owner.gone):
                ch.park()
        left = [(ch, *ch.unacked()) for ch in self.channels.values() if not ch.delivered()]
        if self.link is not None and self.channels:
            self._send_status()
        for ch, msgs, records in left:
            spilled = ch.spill is not None and (ch.spill.held or ch.spill.pending)
            where = (f"{ch.spill.path}" if spilled else "") if ch.released_all() else \
                ch.ring.path + (f" and {ch.spill.path}" if spilled else "")
            log.warning("rank %d (pid %d): %d message(s) not acknowledged (%d records still "
                        "in memory); kept in %s for a relay or `commcheck analyze`",
                        ch.ident.rank, ch.pid, msgs, records, where)
        for ch in self.channels.values():
            gone_or_left = ch.owner.look().state == GONE or ch.ring.state() == STATE_LEFT
            ch.close(remove=gone_or_left and (ch.delivered() or ch.released_all()))
        self.channels.clear()
        if self.link is not None:
            self.link.close(linger=0.2)
        self.release()
        clean = not left and not self.warnings.n
        log.info("relay exits (%s)", "everything delivered" if clean else "see above")
        if clean:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)


# The cyclic GC's generation-0 threshold in the relay (default 700): each record read makes
# a few lists and an entry object that live until its message is cut, so at the default
# the relay collected every ~100 records and scanned its modules' objects again and again:
# ~25 % of its CPU per record (docs/startup.md). Nothing it keeps needs cycles freed early.
GC_THRESHOLD = (50_000, 20, 10)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Fewer GC passes, none over what was there before (frozen: kept anyway); as it was
    after (a relay run in a test's process leaves the process as it found it)."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
