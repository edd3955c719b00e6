"""The ring file: a rank's records, durable outside the rank the moment they are written.

The second contract the sides share (after the messages in :mod:`commcheck.wire`): each
rank writes its records into a memory-mapped file in shared memory (``/dev/shm``), the
node's relay (:mod:`commcheck.relay`) tails it and ships batches to the collector, and
``commcheck analyze`` can read one left behind. docs/decisions.md ("Records outlive the
rank") has the reasoning; this is the layout.

File: ``HEADER_BYTES`` of header, then ``capacity`` bytes of data used as a ring.

Header (little-endian; every dynamic field an aligned 8-byte word, so one store writes it
and a reader never sees half of it):

* static, written by the rank before the file gets its name: magic, version, sizes, the
  rank's pid and its start time (``/proc/<pid>/stat`` field 22, so a reused pid is told
  apart), rank, world, node, local rank and world, creation time, run, host, and the
  destination (collector endpoint or dump directory) the records are for;
* rank-owned: write offset, entries and records written, records dropped (the ring was
  full), internal errors, last-write time (the heartbeat), state (running / goodbye /
  left: the rank stopped waiting for the relay's acks and left the ring to it);
* relay-owned: released offset (the rank may overwrite what lies before it: acknowledged
  by the collector, or spilled to disk by the relay), acked offset and seq (everything
  before them acknowledged), next message seq, the relay's pid and heartbeat, records
  spilled and re-sent, entries rejected, bytes its outbox holds for the rank, flags, the
  spill file's path;
* the journal: ``JOURNAL_SLOTS`` slots, slot ``seq % JOURNAL_SLOTS`` = the message
  ``seq`` (seq, first and end ring offset, send time, records, kind). The relay writes a
  slot, then ``next_seq``, *before* sending the message, so a restarted relay sends the
  same messages under the same names (see :func:`pending_messages`).

Offsets are logical (they only grow); the byte of offset ``o`` is at ``o % capacity`` in the
data area. Each entry is self-contained and 8-byte aligned: a 24-byte head (magic, kind,
payload length, entry number, crc32 of head and payload) and a msgpack payload: a
:class:`~commcheck.wire.Record` as an array of its fields, or a control message (hello,
goodbye with the rank's counters) as ``[t, counters]``. An entry that would cross the end
of the data area is preceded by a pad entry (or, when fewer than 24 bytes are left, by
nothing) and starts at offset 0 of the area.
"""

from __future__ import annotations

import contextlib
import mmap
import operator
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

import msgspec
import numpy as np
import xxhash

from . import (
    ENDINGS,
    GOODBYE,
    HELLO,
    MAX_ERROR_LEN,
    REC_DTYPE,
    RECORDS,
    BatchBuilder,
    CallFailure,
    Chunk,
    DropRange,
    Ending,
    Envelope,
    Record,
    encode,
)
from .private import dir_problem, file_problem, fresh_dir, name_problem

RING_MAGIC = b"CCRING\x00\x01"
RING_VERSION = 1
PAGE = 4096
JOURNAL_SLOTS = 2048
SLOT = struct.Struct("<QQQdII")  # seq, start, end, t, records, kind
JOURNAL_OFF = PAGE
HEADER_BYTES = -(-(JOURNAL_OFF + JOURNAL_SLOTS * SLOT.size) // PAGE) * PAGE
RING_SUFFIX = ".ring"
MIN_CAPACITY = 64 << 10
MAX_CAPACITY = 1 << 34

# Entry head: magic, kind, 0, payload length, entry number, crc32, 0.
ENTRY = struct.Struct("<HBBIQII")
ENTRY_MAGIC = 0xCCE1
_CRC_HEAD = struct.Struct("<BIQ")
K_RECORD, K_HELLO, K_GOODBYE, K_PAD = 1, 2, 3, 0xFF
K_DROPS = 4  # which records the rank dropped: a records message with ``drops``, no records
K_FAILED = 5  # collectives whose real call raised: a records message with ``failed``
KIND_NAMES = {K_RECORD: RECORDS, K_HELLO: HELLO, K_GOODBYE: GOODBYE, K_DROPS: RECORDS,
              K_FAILED: RECORDS}
MAX_ENTRY = 8 << 20  # a payload larger than this (or than a quarter of the ring) is dropped

# STATE_LEFT: the rank gave up waiting for the acks (its close timed out) and left the ring
# to the relay, which removes it once it delivered everything.
STATE_RUNNING, STATE_GOODBYE, STATE_LEFT = 0, 1, 2

# Static header: offsets in bytes.
_STATIC = struct.Struct("<8sIIQqqqqqqQd")  # magic .. created: 96 bytes
_RUN, _HOST, _DEST, _SPILL = 512, 1024, 1536, 2560  # u16 length + utf-8 bytes
_TEXT_MAX = {_RUN: 510, _HOST: 510, _DEST: 1022, _SPILL: 1534}

# Dynamic words: indices into the header viewed as little-endian u64.
W_WRITE, W_ENTRIES, W_RECORDS, W_LAST, W_DROPPED, W_ERRORS, W_STATE = range(16, 23)
# the stop signal (SIGTERM, SIGINT, SIGHUP) the rank got, written by its handler (hot.c): the
# relay reports it once the rank is gone, so a launcher's teardown is told from a failure
W_SIGNAL = 23
# entries, records and last-write time, written together after each entry
HOT = struct.Struct("<QQd")
HOT_OFF = W_ENTRIES * 8
(R_RELEASED_OFF, R_RELEASED_SEQ, R_NEXT_SEQ, R_ACKED_OFF, R_ACKED_SEQ, R_PID, R_BEAT,
 R_SPILLED, R_RESENT, R_FLAGS, R_REJECTED, R_HELD) = range(32, 44)
_FLOAT_WORDS = (W_LAST, R_BEAT)
F_DUMP_OPENED = 1  # relay flag: this ring's dump file was started (a restart appends)
F_REFUSED = 2  # relay flag: the collector refuses the relay's CURVE keys (the rank says so)


class RingError(ValueError):
    """A file that is not a usable ring, or one we must not read (someone else's)."""


@dataclass(frozen=True)
class Identity:
    """Who wrote a ring and where its records go."""

    run: str
    rank: int
    host: str
    world: int
    node: int
    pid: int
    dest: str = ""
    local_rank: int = -1
    local_world: int = 1
    pid_start: int = 0
    created: float = 0.0


# -- names ----------------------------------------------------------------------------------


def run_key(run: str, dest: str) -> str:
    """12 hex digits naming (run, destination): two jobs that share a run id but not a
    collector (or dump directory) never share a relay."""
    return xxhash.xxh3_64_hexdigest(f"{run}\0{dest}".encode())[:12]


def destination(collector: str, dump_dir: str) -> str:
    """Where a run's records go, as ring names and relays know it: the collector's
    endpoint, else ``dump:`` and the dump directory's absolute path."""
    return collector if collector else f"dump:{os.path.abspath(dump_dir)}"


def ring_prefix(uid: int, run: str, dest: str, node: int) -> str:
    """What every file of one relay's (run, destination, node) starts with."""
    return f"commcheck-{uid}-{run_key(run, dest)}-n{node}"


def ring_name(prefix: str, rank: int, pid: int, gen: int = 0) -> str:
    return f"{prefix}-r{rank:05d}-p{pid}-{gen}{RING_SUFFIX}"


def lock_name(prefix: str) -> str:
    return f"{prefix}.lock"


def log_name(prefix: str) -> str:
    return f"{prefix}.relay.log"


def default_ring_dir() -> str:
    """``/dev/shm`` (memory: a record written there survives its process, not a reboot),
    else a private per-user directory under the temporary directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return os.path.join(tempfile.gettempdir(), f"commcheck-{os.getuid()}")


def ensure_private_dir(path: str) -> None:
    """Create ``path`` 0700 if missing; a directory we do not own, or that others may
    write without the sticky bit, is refused (someone could swap our files). The one check
    of a ring directory, for the ranks and the relay alike."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    why = dir_problem(os.lstat(path))
    if why:
        raise RingError(f"{path}: {why}")


def blocked(ring_dir: str, prefix: str) -> str:
    """Why the usual place of a relay's files (``ring_dir``, its lock and log names) cannot
    be used: "" when it can, else one line naming the file and the reason (a folder that
    is not safe, another user's file at the lock's or the log's name)."""
    try:
        ensure_private_dir(ring_dir)
    except (OSError, RingError) as e:
        return str(e) if isinstance(e, RingError) else f"{ring_dir}: {e.strerror}"
    for name in (lock_name(prefix), log_name(prefix)):
        why = name_problem(os.path.join(ring_dir, name))
        if why:
            return why
    return ""


def fresh_ring_dir(ring_dir: str, prefix: str) -> str:
    """A new private folder (0700, random name) for rings whose usual place is
    :func:`blocked`: beside the usual one where that folder is safe, else in the default
    place or the temporary directory. Raises OSError."""
    return fresh_dir([ring_dir, default_ring_dir(), tempfile.gettempdir()], f"{prefix}-")


def open_private(path: str, flags: int, check: bool = True) -> int:
    """``os.open`` that never follows a symlink and refuses a file we do not own, that
    others can read or write, or that is not a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    if check:
        try:
            check_private(fd, path)
        except RingError:
            os.close(fd)
            raise
    return fd


def try_lock(path: str) -> int | None:
    """Take the exclusive ``flock`` on the lock file ``path`` (created 0600 if missing)
    without waiting: the locked descriptor, or None if someone holds it. A lock file is
    removed by whoever holds it when it lets go, so a lock taken on a file that was removed
    meanwhile is dropped and taken again on the current one."""
    import fcntl

    for _ in range(16):
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
            return fd
        os.close(fd)  # removed (and maybe created again) while we waited: try the new one
    raise RingError(f"{path}: the lock file keeps changing")


def unlock(path: str, fd: int) -> None:
    """Let go of a lock from :func:`try_lock` and remove its file (nobody is left holding
    an old one: see there)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    os.close(fd)


def check_private(fd: int, path: str) -> None:
    why = file_problem(os.fstat(fd))
    if why:
        raise RingError(f"{path}: {why}")


# -- entries --------------------------------------------------------------------------------

_FIELDS = tuple(f.name for f in fields(Record))
FIELD_INDEX = {name: i for i, name in enumerate(_FIELDS)}  # into a record's field values
_get_fields = operator.attrgetter(*_FIELDS)
_CHUNKS = _FIELDS.index("chunks")
_GROUP_RANKS = _FIELDS.index("group_ranks")
_TUPLES = tuple(i for i, f in enumerate(fields(Record)) if str(f.type).startswith("tuple"))
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def record_values(r: Record) -> tuple | list:
    """The values of a record's fields as its entry holds them (chunks as tuples)."""
    values = _get_fields(r)
    if r.chunks:
        values = list(values)
        values[_CHUNKS] = [(c.side, c.index, c.h0, c.h1, c.sum) for c in r.chunks]
    return values


def encode_record(r: Record) -> bytes:
    """One record as a msgpack array of its fields (chunks as arrays too)."""
    return _enc.encode(record_values(r))


def layout() -> tuple[int, ...]:
    """What a native writer (commcheck/native/hot.c: ``LAYOUT``) must agree on: entry head
    size and magic, record and pad kinds, the header words it writes, the record's field
    count, and the C API version (ccapi.h)."""
    return (ENTRY.size, ENTRY_MAGIC, K_RECORD, K_PAD, W_WRITE, W_ENTRIES, W_RECORDS, W_LAST,
            W_DROPPED, W_SIGNAL, R_RELEASED_OFF, len(_FIELDS), 1)


def decode_record(payload: bytes | memoryview) -> Record:
    """Raises :class:`RingError` on anything but an encoded record."""
    try:
        values = _dec.decode(payload)
        if not isinstance(values, list) or len(values) != len(_FIELDS):
            raise RingError("not a record entry")
        for i in _TUPLES:
            values[i] = tuple(values[i])
        values[_CHUNKS] = [Chunk(*c) for c in values[_CHUNKS]]
        return Record(*values)
    except (msgspec.DecodeError, TypeError, ValueError) as e:
        raise RingError(f"bad record entry: {e}") from None


_Ints = tuple[int, ...]
_Summary = tuple[float, float, int, int]
# A record entry's fields as :func:`decode_row` gives them, typed as :class:`Record` holds
# them: what a record entry written by commcheck always is (``test_ring`` checks both agree).
_ROW = tuple[str, _Ints, int, str, str, str, int, str, str, int, int, int, _Ints, _Ints, int,
             float, float, float, tuple[int, int], tuple[int, int], _Summary, _Summary,
             list[tuple[int, int, int, int, float]], int, int, _Ints, _Ints]
_rows_dec = msgspec.msgpack.Decoder(list[_ROW])


def decode_row(payload: bytes | memoryview) -> list:
    """A record entry as the values of its fields (for :meth:`BatchBuilder.build_rows`).
    Raises :class:`RingError` on anything but an encoded record."""
    try:
        values = _dec.decode(payload)
    except msgspec.DecodeError as e:
        raise RingError(f"bad record entry: {e}") from None
    if not isinstance(values, list) or len(values) != len(_FIELDS):
        raise RingError("not a record entry")
    return values


def encode_control(t: float, counters: dict[str, int] | None = None,
                   ending: Ending | None = None) -> bytes:
    """A hello or goodbye entry: ``[t, counters]``, a goodbye's ending third (a relay that
    does not know it reads the first two)."""
    if ending is None:
        return _enc.encode([t, counters or {}])
    return _enc.encode([t, counters or {}, ending])


def decode_ending(payload: bytes | memoryview) -> Ending | None:
    """A goodbye entry's ending; None if it has none or it does not read as one."""
    try:
        items = _dec.decode(payload)
        if isinstance(items, list) and len(items) > 2:
            e = msgspec.convert(items[2], Ending)
            if e.how in ENDINGS and -1 <= e.code <= 255 and 0 <= e.signal < 128:
                return msgspec.structs.replace(e, error=e.error[:MAX_ERROR_LEN],
                                               thread=e.thread[:MAX_ERROR_LEN])
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
        pass
    return None


def decode_control(payload: bytes | memoryview) -> tuple[float, dict[str, int]]:
    try:
        t, counters, *_ = _dec.decode(payload)  # a goodbye's ending may follow
        if not isinstance(counters, dict):
            raise TypeError("counters")
        return float(t), {str(k): int(v) for k, v in counters.items()}
    except (msgspec.DecodeError, TypeError, ValueError) as e:
        raise RingError(f"bad control entry: {e}") from None


def encode_drops(t: float, ranges: list[tuple[str, tuple[int, ...], int, int, int]]) -> bytes:
    """A K_DROPS entry: [t, [[group, ranks, phase, first, last], ...]]."""
    return _enc.encode([t, ranges])


def decode_drops(payload: bytes | memoryview) -> tuple[float, list[DropRange]]:
    try:
        t, ranges = _dec.decode(payload)
        return float(t), [DropRange(str(g), [int(r) for r in ranks], int(phase), int(first),
                                    int(last)) for g, ranks, phase, first, last in ranges]
    except (msgspec.DecodeError, TypeError, ValueError) as e:
        raise RingError(f"bad drops entry: {e}") from None


def encode_failed(t: float, failures: list[tuple[str, tuple[int, ...], int, str, str]]
                  ) -> bytes:
    """A K_FAILED entry: [t, [[group, ranks, seq, op, error], ...]]."""
    return _enc.encode([t, failures])


def decode_failed(payload: bytes | memoryview) -> tuple[float, list[CallFailure]]:
    try:
        t, failures = _dec.decode(payload)
        return float(t), [CallFailure(str(g), [int(r) for r in ranks], int(seq), str(op),
                                      str(error)[:MAX_ERROR_LEN])
                          for g, ranks, seq, op, error in failures]
    except (msgspec.DecodeError, TypeError, ValueError) as e:
        raise RingError(f"bad failed entry: {e}") from None


def entry_crc(kind: int, number: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_CRC_HEAD.pack(kind, len(payload), number)))


def entry_size(payload_len: int) -> int:
    return (ENTRY.size + payload_len + 7) & ~7


@dataclass
class Entry:
    """One entry read back: ``off``..``end`` in logical offsets. ``error`` is set (and
    ``payload`` empty) for a damaged region, which spans to the next valid entry; ``lost``
    is how many entries it cost (see :meth:`Ring.entries`)."""

    off: int
    end: int
    kind: int
    number: int
    payload: bytes = b""
    error: str = ""
    lost: int = 0


_MAGIC_BYTES = ENTRY_MAGIC.to_bytes(2, "little")


# -- the file -------------------------------------------------------------------------------


class Ring:
    """A mapped ring file: header words, texts, journal, entries. The rank writes through
    :class:`commcheck.rank.ring.RingWriter`; this class reads, and writes only what the
    relay owns."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, capacity: int | None = None,
                 faults: tuple[str, ...] = ()):
        self.path, self.fd, self.mm = path, fd, mm
        self.words = np.frombuffer(mm, dtype="<u8", count=JOURNAL_OFF // 8)
        self.floats = self.words.view("<f8")
        (magic, version, header, cap, pid, rank, world, node, local_rank, local_world,
         pid_start, created) = _STATIC.unpack_from(mm, 0)
        self.capacity = cap if capacity is None else capacity
        # data bytes the file really holds (fewer than ``capacity`` in a ring cut short):
        # no read ever goes past them
        self.present = min(self.capacity, len(mm) - HEADER_BYTES)
        self.max_entry = min(MAX_ENTRY, self.capacity // 4)  # as the writers cap it
        self.faults = list(faults)  # what Ring.open(salvage=True) found wrong in the header
        self.identity = Identity(
            run=self.text(_RUN), rank=rank, host=self.text(_HOST), world=world, node=node,
            pid=pid, dest=self.text(_DEST), local_rank=local_rank, local_world=local_world,
            pid_start=pid_start, created=created)

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str, writable: bool = True, check_owner: bool = True,
             salvage: bool = False) -> Ring:
        """Map an existing ring. ``check_owner``: refuse a file that is not ours or not 0600
        (the relay always checks; ``analyze`` reads what the user names). ``salvage``
        (read-only): also a ring cut short, or whose capacity field the file's size
        contradicts, the fault kept in ``faults`` (``commcheck analyze`` reads what is left)."""
        salvage = salvage and not writable
        fd = open_private(path, os.O_RDWR if writable else os.O_RDONLY, check_owner)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES + (0 if salvage else MIN_CAPACITY):
                raise RingError(_too_small(fd, path, size))
            head = os.pread(fd, _STATIC.size, 0)
            magic, version, header, capacity = _STATIC.unpack(head)[:4]
            if magic != RING_MAGIC:
                raise RingError(f"{path}: not a commcheck ring (bad magic)")
            if version != RING_VERSION or header != HEADER_BYTES:
                raise RingError(f"{path}: ring version {version}, this commcheck reads "
                                f"{RING_VERSION}")
            faults: tuple[str, ...] = ()
            if capacity % 8 or header + capacity != size:
                if not salvage:
                    raise RingError(f"{path}: ring of {capacity} bytes in a {size}-byte file")
                capacity, faults = _salvaged_capacity(path, capacity, size - HEADER_BYTES)
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, capacity, faults)

    @classmethod
    def create(cls, path: str, capacity: int, ident: Identity) -> Ring:
        """A new ring, 0600, its space reserved (a full tmpfs fails here with ENOSPC, never
        later with SIGBUS). It is made under a hidden random name and linked to ``path``
        once its header is complete, so a relay never sees half a header; FileExistsError
        if ``path`` exists. Raises OSError or RingError."""
        capacity = max(MIN_CAPACITY, min(MAX_CAPACITY, capacity)) & ~7
        folder, name = os.path.split(path)
        # a random name made O_EXCL, 0600: nobody can create it first (a fixed one could be)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        mm = None
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            size = HEADER_BYTES + capacity
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
            _STATIC.pack_into(mm, 0, RING_MAGIC, RING_VERSION, HEADER_BYTES, capacity,
                              ident.pid, ident.rank, ident.world, ident.node, ident.local_rank,
                              ident.local_world, ident.pid_start, ident.created or time.time())
            for off, value in ((_RUN, ident.run), (_HOST, ident.host), (_DEST, ident.dest)):
                _put_text(mm, off, value)
            os.link(tmp, path)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return cls(path, fd, mm)

    def is_at(self, path: str) -> bool:
        """Whether ``path`` still names this file (not removed, nor made anew)."""
        try:
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(self.fd)
        return (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev)

    def close(self) -> None:
        if self.mm is not None:
            self.words = self.floats = None  # type: ignore[assignment]
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None  # type: ignore[assignment]
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- header ----------------------------------------------------------------------------

    def text(self, off: int) -> str:
        (n,) = struct.unpack_from("<H", self.mm, off)
        n = min(n, _TEXT_MAX[off])
        return bytes(self.mm[off + 2:off + 2 + n]).decode("utf-8", "replace")

    def word(self, i: int) -> int:
        return int(self.words[i])

    def set_word(self, i: int, value: int) -> None:
        self.words[i] = value

    def when(self, i: int) -> float:
        return float(self.floats[i])

    def set_when(self, i: int, value: float) -> None:
        self.floats[i] = value

    @property
    def spill_path(self) -> str:
        return self.text(_SPILL)

    @spill_path.setter
    def spill_path(self, value: str) -> None:
        _put_text(self.mm, _SPILL, value)

    def state(self) -> int:
        return self.word(W_STATE)

    def counters(self) -> dict[str, int]:
        """The rank's and the relay's counts, as messages carry them."""
        w = self.words
        return {"records": int(w[W_RECORDS]), "dropped": int(w[W_DROPPED]),
                "errors": int(w[W_ERRORS]), "spilled": int(w[R_SPILLED]),
                "resent": int(w[R_RESENT]), "rejected_entries": int(w[R_REJECTED])}

    # -- journal ---------------------------------------------------------------------------

    def slot(self, seq: int) -> tuple[int, int, int, float, int, int] | None:
        """(seq, start, end, t, records, kind) journaled for message ``seq``, or None."""
        got = SLOT.unpack_from(self.mm, JOURNAL_OFF + (seq % JOURNAL_SLOTS) * SLOT.size)
        return got if got[0] == seq else None

    def journal(self, seq: int, start: int, end: int, t: float, records: int,
                kind: int) -> None:
        """Record message ``seq`` (relay only), then make it count: ``next_seq``."""
        SLOT.pack_into(self.mm, JOURNAL_OFF + (seq % JOURNAL_SLOTS) * SLOT.size,
                       seq, start, end, t, records, kind)
        self.words[R_NEXT_SEQ] = seq + 1

    # -- entries ---------------------------------------------------------------------------

    def entry_at(self, off: int, limit: int) -> Entry | None:
        """The entry at logical ``off`` (pads skipped), if it is complete before ``limit``:
        a valid one, one with ``error`` set, or None (nothing there yet)."""
        cap, base, mm, present = self.capacity, HEADER_BYTES, self.mm, self.present
        while off < limit:
            pos = off % cap
            if cap - pos < ENTRY.size:  # too little room for a head: the writer wrapped
                off += cap - pos
                continue
            if pos + ENTRY.size > present:  # the file ends before: nothing more this lap
                return Entry(off, min(limit, off + cap - pos), 0, 0, error="cut short")
            magic, kind, zero, n, number, crc, zero2 = ENTRY.unpack_from(mm, base + pos)
            if magic != ENTRY_MAGIC:
                return Entry(off, off + 8, 0, 0, error="bad magic")
            if zero or zero2:  # every byte of a head is checked: these by the writers' zeros
                return Entry(off, off + 8, 0, 0, error="bad head")
            if kind == K_PAD:
                if n != cap - pos - ENTRY.size or crc != entry_crc(K_PAD, number, b""):
                    return Entry(off, off + 8, 0, 0, error="bad pad")
                off += cap - pos
                continue
            size = entry_size(n)
            if n > self.max_entry or pos + size > cap:
                return Entry(off, off + 8, 0, 0, error="bad length")
            if off + size > limit:
                return Entry(off, off + 8, 0, 0, error="past the write offset")
            if pos + ENTRY.size + n > present:
                return Entry(off, min(limit, off + cap - pos), 0, 0, error="cut short")
            payload = bytes(mm[base + pos + ENTRY.size:base + pos + ENTRY.size + n])
            if crc != entry_crc(kind, number, payload) or kind not in KIND_NAMES:
                return Entry(off, off + 8, 0, 0, error="bad checksum")
            return Entry(off, off + size, kind, number, payload)
        return None

    def records_at(self, off: int, limit: int, most: int) -> tuple[list[bytes], int, int]:
        """Up to ``most`` record entries from logical ``off`` on, complete before ``limit``,
        in one pass: their payloads, the offset after the last one and its number. The
        relay's common case, a stream of records, without an :class:`Entry` per record
        (docs/startup.md). It stops at whatever :meth:`entry_at` would not return as a valid
        record (a control entry, a pad, the wrap, damage, the end): that reads it next."""
        cap, base, mm = self.capacity, HEADER_BYTES, self.mm
        lap = off - off % cap
        end = min(limit, lap + min(cap, self.present))  # this lap, and bytes the file has
        unpack, crc32, crc_head = ENTRY.unpack_from, zlib.crc32, _CRC_HEAD.pack
        payloads: list[bytes] = []
        number, head, most_n = -1, ENTRY.size, self.max_entry
        while off + head <= end and len(payloads) < most:
            pos = base + off - lap
            magic, kind, zero, n, num, crc, zero2 = unpack(mm, pos)
            size = (head + n + 7) & ~7
            if magic != ENTRY_MAGIC or kind != K_RECORD or zero or zero2 or n > most_n or \
                    off + size > end:
                break
            payload = mm[pos + head:pos + head + n]
            if crc != crc32(payload, crc32(crc_head(kind, n, num))):
                break
            payloads.append(payload)
            number, off = num, off + size
        return payloads, off, number

    def entries(self, start: int, end: int, first: int | None = None,
                last: int | None = None) -> Iterator[Entry]:
        """Entries in [start, end), at most one ring's length: valid ones, and one error per
        damaged stretch, which ends where the next valid entry starts (found by the entry
        magic at 8-byte steps; numbers only grow, so an older entry is not one). Its
        ``lost``: the entries it cost, from the numbers around it (``first``: the number the
        entry at ``start`` has, ``last``: the header's count of entries written; None if
        unknown), at least one where they cannot tell, never more than its bytes hold."""
        end = min(end, start + self.capacity)
        prev = None if first is None else first - 1
        budget = [4 * self.capacity + 2 * self.max_entry]  # bytes checked while resyncing
        off = start
        while off < end:
            e = self.entry_at(off, end)
            if e is None:
                return
            if not e.error and (prev is None or e.number > prev):
                yield e
                prev, off = e.number, e.end
                continue
            why = e.error or f"entry {e.number} after {prev}: old"
            nxt = self._resync(e.end if e.error else e.off + 8, end, prev, last, budget)
            stop = end if nxt is None else nxt.off
            after = last if nxt is None else nxt.number
            yield Entry(e.off, stop, 0, 0, error=why,
                        lost=_lost(prev, after, stop - e.off, nxt is None and last is None))
            if nxt is None:
                return
            off = stop

    def _resync(self, off: int, end: int, prev: int | None, last: int | None,
                budget: list[int]) -> Entry | None:
        """The first valid entry at or after ``off`` (8-byte aligned) numbered after
        ``prev`` (and before ``last``), or None. ``budget``: bytes it may still checksum
        (a file full of false magics costs a few passes over it, not one per candidate)."""
        cap, base, mm = self.capacity, HEADER_BYTES, self.mm
        stop = min(cap, self.present)
        while off < end and budget[0] > 0:
            pos = off % cap
            i = mm.find(_MAGIC_BYTES, base + pos, base + stop) - base if pos < stop else -1
            if i < 0:
                off += cap - pos  # none this lap: go on from the wrap
                continue
            off += i - pos
            if i % 8 or i + ENTRY.size > stop:
                off += 8 - i % 8
                continue
            _, _, _, n, number, _, _ = ENTRY.unpack_from(mm, base + i)
            if (prev is None or number > prev) and (last is None or number < last):
                budget[0] -= ENTRY.size + min(n, self.max_entry)
                e = self.entry_at(off, end)
                if e is not None and not e.error and (prev is None or e.number > prev):
                    return e
            off += 8
        return None


def _lost(prev: int | None, after: int | None, nbytes: int, open_end: bool) -> int:
    """Entries a damaged stretch of ``nbytes`` cost, between the entry numbered ``prev``
    and the one numbered ``after`` (None: unknown). A stretch that runs to an end nobody
    vouches for (``open_end``) may be space never written: it costs none."""
    most = max(1, nbytes // ENTRY.size)  # an entry is a head at least
    if prev is not None and after is not None:
        return min(max(after - prev - 1, 0), most)
    return 0 if open_end else 1


def _too_small(fd: int, path: str, size: int) -> str:
    """Why a file too short for a ring is refused; for one cut inside its header, how many
    entries its rank had written (when the header still says)."""
    if size < JOURNAL_OFF:
        return f"{path}: too small for a ring ({size} bytes)"
    (entries,) = struct.unpack("<Q", os.pread(fd, 8, W_ENTRIES * 8))
    return (f"{path}: cut short at {size} bytes, inside its {HEADER_BYTES}-byte header: "
            f"none of its {entries} entries are left")


def _salvaged_capacity(path: str, capacity: int, data: int) -> tuple[int, tuple[str, ...]]:
    """A read-only ring whose capacity field and size disagree: cut short (the field is
    plausible, the data shorter), or a damaged field the file's size replaces."""
    def plausible(n: int) -> bool:
        return MIN_CAPACITY <= n <= MAX_CAPACITY and not n % 8

    if plausible(capacity) and 0 <= data < capacity:
        return capacity, (f"cut short: {data} of its {capacity} data bytes left",)
    if plausible(data):
        return data, (f"capacity field {capacity} does not fit the file: read as {data}",)
    raise RingError(f"{path}: ring of {capacity} bytes in a {data + HEADER_BYTES}-byte file")


def _put_text(mm: mmap.mmap, off: int, value: str) -> None:
    raw = value.encode()[:_TEXT_MAX[off]]
    struct.pack_into("<H", mm, off, len(raw))
    mm[off + 2:off + 2 + len(raw)] = raw


# -- messages -------------------------------------------------------------------------------


# Notes a rank leaves between records, sent as a records message without records: the
# entry kind's Envelope field and its decoder.
_NOTES = {K_DROPS: ("drops", decode_drops), K_FAILED: ("failed", decode_failed)}
# Tests only: seconds added to every time a node's records carry, as a node whose clock is
# that far off would stamp them (docs/stragglers.md: lateness must not depend on clocks).
CLOCK_SHIFT_ENV = "COMMCHECK_TEST_CLOCK_SHIFT"


def _clock_shift() -> float:
    try:
        return float(os.environ.get(CLOCK_SHIFT_ENV, "") or 0.0)
    except ValueError:
        return 0.0


def _shifted(env: Envelope, shift: float) -> None:
    rec = np.frombuffer(env.records, REC_DTYPE).copy()
    for f in ("t_enter", "t_exit", "t_done"):
        rec[f] = np.where(rec[f] != 0, rec[f] + shift, 0.0)
    env.records, env.t = rec.tobytes(), env.t + shift


def message(ring: Ring, builder: BatchBuilder, seq: int, items: list[Entry], t: float,
            extra: dict[str, int] | None = None) -> tuple[bytes, int, int]:
    """The message ``seq`` made of ``items`` (records, or one control entry): (encoded
    envelope, records, kind). Named (run, rank, the rank's pid, seq). Entries that do not
    decode are left out and counted in ``extra['rejected']``."""
    ident = ring.identity
    counters = ring.counters()
    if extra:
        counters.update(extra)
    if len(items) == 1 and items[0].kind in _NOTES:
        kind = items[0].kind
        field, decode_note = _NOTES[kind]
        try:
            t, notes = decode_note(items[0].payload)
        except RingError:
            notes = []
            if extra is not None:
                extra["rejected"] = extra.get("rejected", 0) + 1
        env = builder.build_rows([], seq, t, counters=counters)
        env.pid = ident.pid
        setattr(env, field, notes)
        return encode(env), 0, kind
    if len(items) == 1 and items[0].kind != K_RECORD:
        e = items[0]
        try:
            t, final = decode_control(e.payload)
        except RingError:
            final = {}
        if e.kind == K_GOODBYE:
            counters.update(final)
        env = builder.control(KIND_NAMES[e.kind], seq, t, ident.pid,
                              counters=counters if e.kind == K_GOODBYE else None)
        if e.kind == K_GOODBYE:
            env.ending = decode_ending(e.payload)
        return encode(env), 0, e.kind
    payload, n = records_message(ring, builder, seq, [e.payload for e in items], t, extra,
                                 counters)
    return payload, n, K_RECORD


def records_message(ring: Ring, builder: BatchBuilder, seq: int, payloads: list[bytes],
                    t: float, extra: dict[str, int] | None = None,
                    counters: dict[str, int] | None = None) -> tuple[bytes, int]:
    """The records message ``seq`` made of these record entries' payloads: (encoded
    envelope, records). Payloads that do not decode into a record are left out and counted
    in ``extra['rejected']``."""
    if counters is None:
        counters = ring.counters()
        if extra:
            counters.update(extra)
    rows = decode_rows(payloads, extra)
    try:
        env: Envelope = builder.build_rows(rows, seq, t, counters=counters)
    except (TypeError, ValueError, IndexError, OverflowError):  # a row of the wrong shape
        good = []
        for row in rows:
            try:
                builder.build_rows([row], seq)
                good.append(row)
            except (TypeError, ValueError, IndexError, OverflowError):
                if extra is not None:
                    extra["rejected"] = extra.get("rejected", 0) + 1
        rows = good
        env = builder.build_rows(rows, seq, t, counters=counters)
    env.pid = ring.identity.pid
    shift = _clock_shift()
    if shift:
        _shifted(env, shift)
    return encode(env), len(rows)


def decode_rows(payloads: list[bytes], extra: dict[str, int] | None = None) -> list:
    """Record payloads as rows for :meth:`BatchBuilder.build_rows`. All at once, as one
    msgpack array checked against the record's types, where every payload is such a
    record (one decode call for the batch: docs/startup.md); otherwise one by one, those
    that are not counted in ``extra['rejected']``."""
    try:
        return _rows_dec.decode(_array_head(len(payloads)) + b"".join(payloads))
    except (msgspec.DecodeError, OverflowError):  # ValidationError is a DecodeError
        pass
    rows = []
    for payload in payloads:
        try:
            rows.append(decode_row(payload))
        except RingError:
            if extra is not None:
                extra["rejected"] = extra.get("rejected", 0) + 1
    return rows


def _array_head(n: int) -> bytes:
    """The msgpack head of an array of ``n`` items (array 32: any count a batch has)."""
    return b"\xdd" + n.to_bytes(4, "big")


def builder_for(ring: Ring) -> BatchBuilder:
    i = ring.identity
    return BatchBuilder(i.run, i.rank, i.host, i.world, i.node)


def pending_messages(ring: Ring, builder: BatchBuilder | None = None
                     ) -> Iterator[tuple[int, int, bytes, int, int]]:
    """The messages journaled but not released (what a restarted relay re-sends, under the
    same names): (seq, end offset, encoded message, records, kind), in seq order."""
    builder = builder or builder_for(ring)
    first = ring.word(R_RELEASED_SEQ)
    for seq in range(first, min(ring.word(R_NEXT_SEQ), first + JOURNAL_SLOTS)):
        slot = ring.slot(seq)
        if slot is None:
            continue
        _, start, end, t, _, kind = slot
        items = [e for e in ring.entries(start, end) if not e.error]
        if not items and kind != K_RECORD:
            continue
        payload, n, _ = message(ring, builder, seq, items, t)
        yield seq, end, payload, n, kind


def read_offset(ring: Ring) -> int:
    """Where the entries no message holds yet begin: the end of the last journaled one."""
    nxt = ring.word(R_NEXT_SEQ)
    if nxt > ring.word(R_RELEASED_SEQ):
        slot = ring.slot(nxt - 1)
        if slot is not None:
            return slot[2]
    return ring.word(R_RELEASED_OFF)


def proc_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), None if unreadable."""
    stat_ = proc_stat(pid)
    return stat_[1] if stat_ else None


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, start time, exit status as waitpid reports it, or -1) of ``pid``;
    None when it does not exist (or /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        exit_status = int(rest[49]) if len(rest) > 49 else -1
        return rest[0].decode(), int(rest[19]), exit_status
    except (IndexError, ValueError):
        return None
