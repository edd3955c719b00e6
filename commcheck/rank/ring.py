"""How records leave a rank: written into the rank's ring file, read by the node's relay.

The training thread encodes each record and copies it into a memory-mapped ring in shared
memory (:mod:`commcheck.wire.ring` has the layout): the record is then durable outside the
process, so a rank killed right after a collective (the OOM killer, SIGKILL) still leaves
its last records for the relay, which ships them to the collector (or the dump file). No
socket, no sender thread: a completion whose device fingerprints are still on their way
waits for the resolver thread (:mod:`.resolver`), which also checks every second that a
relay holds this run's lock on this node and starts one when none does
(:mod:`.relay_launch`); a forked child lets the ring go (:mod:`.forks`); the goodbye says
which stop signal came (:mod:`.stop_signals`).

Bounds: a full ring drops the record, counted (the relay spills to disk long before, when
the collector is away and ``spill_dir`` is set; see docs/decisions.md); the resolver queue
holds at most ``queue_records``. Nothing here raises into training.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import replace

from ..native import hot as native_hot
from ..wire import Ending, Record
from ..wire.private import REFUSED_FILE, name_problem
from ..wire.relay_settings import RelaySettings
from ..wire.ring import (
    ENTRY,
    ENTRY_MAGIC,
    F_REFUSED,
    FIELD_INDEX,
    HEADER_BYTES,
    HOT,
    HOT_OFF,
    K_DROPS,
    K_FAILED,
    K_GOODBYE,
    K_HELLO,
    K_PAD,
    K_RECORD,
    MAX_ENTRY,
    R_ACKED_OFF,
    R_FLAGS,
    R_RELEASED_OFF,
    STATE_GOODBYE,
    STATE_LEFT,
    W_DROPPED,
    W_ENTRIES,
    W_ERRORS,
    W_RECORDS,
    W_STATE,
    W_WRITE,
    Identity,
    Ring,
    RingError,
    blocked,
    default_ring_dir,
    encode_control,
    encode_drops,
    encode_failed,
    encode_record,
    entry_crc,
    fresh_ring_dir,
    layout,
    record_values,
    ring_name,
    ring_prefix,
)
from .drops import DropBook
from .forks import release_in_children
from .relay_launch import RelayLaunch, say_refused
from .resolver import Duty, Pending, Resolver
from .stop_signals import ending_with_signal, remark

log = logging.getLogger("commcheck")

WATCH_INTERVAL = 1.0  # seconds between the resolver thread's duties (relay there, mark)
_generation = itertools.count()  # the rings this process made: each name is used once


_CLOSED = 3  # ccapi.h CC_PUT_CLOSED: the ring closed under the writer (stop): nothing to say
_SEQ, _PHASE = FIELD_INDEX["seq"], FIELD_INDEX["phase"]


def _new_ring(ring_dir: str, prefix: str, ident: Identity, capacity: int
              ) -> tuple[Ring, str]:
    """The ring, and what stood at its usual name ("" if nothing): a name taken by another
    user's file is left alone and the ring made under a random generation instead."""
    planted = ""
    for _ in range(64):  # a process may patch, unpatch and patch again: never one name twice
        gen = next(_generation) if not planted else secrets.randbits(40)
        path = os.path.join(ring_dir, ring_name(prefix, ident.rank, ident.pid, gen))
        try:
            return Ring.create(path, capacity, ident), planted
        except FileExistsError:
            planted = planted or name_problem(path)
    raise RingError(f"{ring_dir}: 64 rings of this process exist already")


def _native_ring(ring: Ring, max_entry: int, on_drop, say_drops) -> object | None:
    """The ring written from C (native/hot.c), when the extension is here and agrees with
    this ring's layout; else None (the Python writer below)."""
    mod = native_hot.module()
    if mod is None or tuple(mod.LAYOUT) != layout():
        return None
    try:
        hot = mod.Ring(ring.mm, HEADER_BYTES, ring.capacity, max_entry, on_drop, say_drops)
        mod.mark_stops(hot)
        return hot
    except (TypeError, ValueError, BufferError) as e:
        log.warning("commcheck: the native ring writer is unavailable (%r)", e)
        return None


class RingWriter:
    """A rank's ring: :meth:`submit` on the training thread (O(1) plus one encode and
    copy), the resolver thread for pending device work, :meth:`close` at exit."""

    def __init__(self, ring: Ring, launch: RelayLaunch | None = None,
                 queue_records: int = 65536):
        self.ring = ring
        self.path = ring.path
        self.launch = launch
        self.queue_records = queue_records
        self.counters: dict[str, int] = {}  # extra counts for the goodbye (set by Session)
        self.at_exit = False  # the goodbye is said from the exit handlers (set by Session)
        self._mm, self._words, self._floats = ring.mm, ring.words, ring.floats
        self._cap = ring.capacity
        self._max_entry = min(MAX_ENTRY, self._cap // 4)
        self._lock = threading.Lock()
        self._closed_at = (0, 0, 0, 0)  # write offset, entries, records, dropped once closed
        self._errors = 0
        self._drops = DropBook()  # which records were dropped, until the ring has room to say
        self._drops_lock = threading.Lock()
        self._resolver = Resolver(self.write_record, self._error, self._lost, (
            Duty(self._watch, WATCH_INTERVAL),
            Duty(self._remark, WATCH_INTERVAL, first=WATCH_INTERVAL)))  # just marked
        self._said_refused = False
        self.closed = False
        self._hot = _native_ring(ring, self._max_entry, self._note_values, self._say_drops)
        release_in_children(self)
        self.final: dict[str, int] = {}

    # The writer's state lives in the ring's header (the native path writes it there too).
    def _word(self, index: int, closed: int) -> int:
        words = self._words
        return int(words[index]) if words is not None else self._closed_at[closed]

    @property
    def _write(self) -> int:
        return self._word(W_WRITE, 0)

    @property
    def _number(self) -> int:
        return self._word(W_ENTRIES, 1)

    @property
    def _records(self) -> int:
        return self._word(W_RECORDS, 2)

    @property
    def _dropped(self) -> int:
        return self._word(W_DROPPED, 3)

    @classmethod
    def create(cls, ring_dir: str, ident: Identity, capacity: int,
               relay: RelaySettings | None = None, queue_records: int = 65536) -> RingWriter:
        """A new ring in ``ring_dir`` (``""``: /dev/shm, else a private temp directory),
        named so the relay of (run, destination, node) finds it; with ``relay``, this rank
        starts that relay when none runs. Where another user's file is in the way (the
        folder, the relay's lock or log, the ring's own name), the ring goes to a fresh
        private folder (with a relay of its own) or a random name, said in one line and in
        the goodbye (``refused_file:<what>``). Raises OSError/RingError."""
        ring_dir = os.path.abspath(ring_dir or default_ring_dir())
        prefix = ring_prefix(os.getuid(), ident.run, ident.dest, ident.node)
        refused = blocked(ring_dir, prefix)
        if refused:
            ring_dir = fresh_ring_dir(ring_dir, prefix)
            if relay is not None:
                relay = replace(relay, expect=1)  # a relay for this rank's folder alone
            log.warning("commcheck: rank %d: %s; recording into %s with a relay of its own",
                        ident.rank, refused, ring_dir)
        ring, planted = _new_ring(ring_dir, prefix, ident, capacity)
        if planted:
            log.warning("commcheck: rank %d: %s; the ring is %s instead", ident.rank, planted,
                        ring.path)
        launch = RelayLaunch(ring_dir, prefix, replace(relay, ring_dir=ring_dir)) \
            if relay is not None else None
        writer = cls(ring, launch, queue_records)
        for why in (refused, planted):
            if why:
                writer.counters[f"{REFUSED_FILE}{why}"] = 1
        return writer

    # -- lifecycle -------------------------------------------------------------------------

    def forked(self) -> None:
        """In a forked child (a DataLoader worker, say): the parent's ring is not ours."""
        self.closed = True
        self._mm = self._words = self._floats = None  # type: ignore[assignment]
        self._hot = None
        self._resolver.forget()
        self.launch = None

    def start(self) -> None:
        """The hello, then the resolver thread (which starts the relay if none runs: the
        training thread never forks)."""
        self._write_entry(K_HELLO, encode_control(time.time()), 0)
        self._resolver.start()

    def _ending(self) -> Ending | None:
        """How the process is ending (rank/ending.py), with the stop signal it got (the
        mark hot.c's handler left in the ring); None if it cannot be told."""
        try:
            return ending_with_signal(self._words, self.at_exit)
        except Exception as e:  # the goodbye goes without it
            self._errors += 1
            log.warning("commcheck: how the process ends is unknown: %r", e)
            return None

    def close(self, linger: float) -> bool:
        """Resolve what is pending (waiting at most ``linger`` for device work), say goodbye
        with the final counters, wait (at most ``linger``) until the relay acknowledged
        everything, and remove the ring. Returns whether everything was acknowledged; if
        not, the ring stays for a relay (or ``commcheck analyze``) to read."""
        if self.closed:
            return True
        self.closed = True
        deadline = time.monotonic() + linger
        self._resolver.resolve(deadline, last=True)
        while self._drops and not self._say_drops():  # before the goodbye: its counts are final
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        counters = {**self.counters, "records": self._records, "dropped": self._dropped,
                    "errors": self._errors}
        goodbye = encode_control(time.time(), counters, self._ending())
        while not self._write_entry(K_GOODBYE, goodbye, 0, count_drop=False):
            if time.monotonic() > deadline:  # a full ring and no relay: the goodbye is lost
                break
            time.sleep(0.005)
        self._words[W_STATE] = STATE_GOODBYE
        self._resolver.wake()
        acked = self.wait_acked(deadline)
        self._resolver.stop()
        self.final = self.stats()
        if not acked:
            self._check_refused()
        if acked:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        elif self._said_refused:  # that line says it all
            self._words[W_STATE] = STATE_LEFT
        elif int(self._words[R_RELEASED_OFF]) >= self._write:
            with contextlib.suppress(OSError):  # nothing is in the ring alone: it is spilled
                os.unlink(self.path)
            log.warning("commcheck: the collector did not acknowledge every record before "
                        "exit; the relay keeps them in its spill file")
        else:
            self._words[W_STATE] = STATE_LEFT  # the relay removes it once delivered
            log.warning("commcheck: the relay did not acknowledge %d bytes of records before "
                        "exit; they stay in %s for the relay or `commcheck analyze`",
                        self._write - int(self._words[R_ACKED_OFF]), self.path)
        with self._lock:
            self._closed_at = (self._write, self._number, self._records, self._dropped)
            if self._hot is not None:
                self._hot.close()
                self._hot = None
            self._mm = self._words = self._floats = None  # type: ignore[assignment]
            self.ring.close()
        return acked

    def wait_acked(self, deadline: float) -> bool:
        while int(self._words[R_ACKED_OFF]) < self._write:
            if time.monotonic() > deadline or int(self._words[R_FLAGS]) & F_REFUSED:
                return False
            time.sleep(0.005)
        return True

    # -- writing ---------------------------------------------------------------------------

    def submit(self, item: Pending) -> None:
        """Called on the training thread: a ready record is written now; one waiting for
        its device fingerprints goes to the resolver thread. Never blocks, never raises."""
        try:
            if item.ready():
                self.write_record(item.finalize())
                return
            if len(self._resolver) >= self.queue_records:
                self._drop(1)
                self._note_drop(item)
                return
            self._resolver.add(item)
        except Exception as e:
            self._error(e)

    @property
    def native(self) -> bool:
        """Records are written from C (native/hot.c): :meth:`write_values` may be used."""
        return self._hot is not None

    def native_handle(self) -> object | None:
        """The ring as a capsule for C/C++ writers (ccapi.h); None where it is written from
        Python."""
        hot = self._hot
        return native_hot.module().ring_handle(hot) if hot is not None else None  # type: ignore[union-attr]

    def write_values(self, values: list | tuple) -> bool:
        """A record given as its field values (``record_values``), written from C; a full
        ring drops it and notes which, as :meth:`write_record`. Native writers only."""
        try:
            status = self._hot.put_record(values)  # type: ignore[union-attr]
        except Exception as e:
            self._error(e)
            return False
        if status == 0:
            return True
        if status != _CLOSED:
            self._note_values(values[0], values[1], values[_PHASE], values[_SEQ])
        return False

    def write_record(self, r: Record) -> bool:
        if self._hot is not None:
            return self.write_values(record_values(r))
        try:
            payload = encode_record(r)
        except Exception as e:
            self._error(e)
            return False
        if self._drops.n:
            self._say_drops()
        if self._write_entry(K_RECORD, payload, 1):
            return True
        self._note_drop(r)
        return False

    def write_failure(self, r: Record, error: str) -> bool:
        """Say that the call ``r`` records raised ``error`` after torch accepted it (a
        K_FAILED entry, after its entry record): the report names the error."""
        try:
            payload = encode_failed(time.time(), [(r.group_name, r.group_ranks, r.seq, r.op,
                                                   error)])
        except Exception as e:
            self._error(e)
            return False
        return self._write_entry(K_FAILED, payload, 0, count_drop=False)

    def _lost(self, items: Iterable[Pending]) -> None:
        """Pending records whose device work never finished by the goodbye: dropped."""
        items = list(items)
        self._drop(len(items))
        for item in items:
            self._note_drop(item)

    def _note_drop(self, item: Record | Pending) -> None:
        """Remember which record was dropped (a pending one by the record it will be)."""
        r = item if isinstance(item, Record) else getattr(item, "record", None)
        if isinstance(r, Record):
            self._note_values(r.group_name, r.group_ranks, r.phase, r.seq)

    def _note_values(self, group: str, ranks: tuple[int, ...], phase: int, seq: int) -> None:
        with self._drops_lock:
            self._drops.note_key(group, ranks, phase, seq)
        if self._hot is not None:
            self._hot.mark_drops()  # said before its next record

    def _say_drops(self) -> bool:
        """Write the dropped ranges noted so far, if the ring has room now."""
        with self._drops_lock:
            ranges = self._drops.take()
            budget = self._max_entry // 2  # an entry stays small: a group's ranks add up
            i = 0
            while i < len(ranges):
                n, size = 0, 0
                while i + n < len(ranges) and (n == 0 or size < budget):
                    size += 32 + 5 * len(ranges[i + n][1]) + len(ranges[i + n][0])
                    n += 1
                if not self._write_entry(K_DROPS, encode_drops(time.time(), ranges[i:i + n]),
                                         0, count_drop=False):
                    self._drops.put_back(ranges[i:])
                    return False
                i += n
            return True

    def _write_entry(self, kind: int, payload: bytes, records: int,
                     count_drop: bool = True) -> bool:
        hot = self._hot
        if hot is not None:
            return hot.put(kind, payload, records, count_drop) == 0
        n = len(payload)
        size = (ENTRY.size + n + 7) & ~7
        cap, mm, words = self._cap, self._mm, self._words
        with self._lock:
            if mm is None or self._mm is None:
                return False
            if n > self._max_entry:
                if count_drop:
                    self._drop(records)
                return False
            off = int(words[W_WRITE])
            pos = off % cap
            pad = cap - pos if pos + size > cap else 0
            if off + pad + size - int(words[R_RELEASED_OFF]) > cap:
                if count_drop:
                    self._drop(records)
                return False
            number = int(words[W_ENTRIES])
            if pad:
                if pad >= ENTRY.size:
                    ENTRY.pack_into(mm, HEADER_BYTES + pos, ENTRY_MAGIC, K_PAD, 0,
                                    pad - ENTRY.size, number, entry_crc(K_PAD, number, b""), 0)
                off += pad
                pos = 0
            base = HEADER_BYTES + pos
            mm[base + ENTRY.size:base + ENTRY.size + n] = payload
            ENTRY.pack_into(mm, base, ENTRY_MAGIC, kind, 0, n, number,
                            entry_crc(kind, number, payload), 0)
            HOT.pack_into(mm, HOT_OFF, number + 1, int(words[W_RECORDS]) + records, time.time())
            words[W_WRITE] = off + size  # last (one aligned 8-byte store): publishes it
        return True

    def _drop(self, n: int) -> None:
        with contextlib.suppress(Exception):
            self._words[W_DROPPED] += n

    def _error(self, e: BaseException) -> None:
        self._errors += 1
        with contextlib.suppress(Exception):
            self._words[W_ERRORS] = self._errors
        if self._errors == 1:
            log.warning("commcheck: could not write a record (counted): %r", e)

    def stats(self) -> dict[str, int]:
        """The counts the collector will see for this rank (the relay's included)."""
        return {**self.counters, **self.ring.counters()} if self.ring.mm is not None \
            else {**self.counters, "records": self._records, "dropped": self._dropped}

    # -- the resolver thread's duties ------------------------------------------------------

    def _remark(self) -> None:
        if self._hot is not None:
            remark()

    def _check_refused(self) -> None:
        """The relay flags a refusal of its CURVE keys in the ring: say it, once, in one
        line, instead of a count of unacknowledged records at exit."""
        if self._said_refused or not int(self._words[R_FLAGS]) & F_REFUSED:
            return
        self._said_refused = True
        say_refused(self.launch.settings if self.launch else None, self.path)

    def _watch(self) -> None:
        if self.launch is None:
            return
        with contextlib.suppress(Exception):
            self._check_refused()
        self.launch.watch(self.path)
