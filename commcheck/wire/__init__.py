"""The wire schema: the only thing the rank side and the collector side share.

A message is one msgpack map (an :class:`Envelope`). Records travel *columnar*: fixed-width
fields of all records of a batch are one numpy structured array (``REC_DTYPE``), per-chunk
hashes another (``CHUNK_DTYPE``), shapes a flat int64 array, and every string (op, dtype,
call site, ...) is an index into the batch's string table. A collector therefore decodes a
batch of any size with one msgpack decode and three ``np.frombuffer`` calls, never one
Python object per record. Per-rank dump files hold the same encoded envelopes, framed.
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import msgspec
import numpy as np
import xxhash

WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20
MAX_RECORDS_PER_BATCH = 1 << 20
MAX_STRINGS = 1 << 16
MAX_STRING_LEN = 4096
MAX_WORLD = 1 << 22  # ranks in a job: the largest runs are ~10^5 GPUs

HELLO, RECORDS, GOODBYE = "hello", "records", "goodbye"
# A relay's observations of the ranks on its node (liveness): not a rank's message, never
# acknowledged or deduplicated, the latest one wins. See RankStatus.
STATUS = "status"
KINDS = (HELLO, RECORDS, GOODBYE, STATUS)
MAX_STATUS = 1 << 12  # ranks in one status message

# RankStatus.state
ALIVE, STOPPED, GONE = "alive", "stopped", "gone"
STATES = (ALIVE, STOPPED, GONE)

# Record flags: which fields are valid, and how the call ran.
F_ASYNC = 1 << 0
F_INJECTED = 1 << 1  # fault injection altered this call's output
F_IN_HASH = 1 << 2
F_IN_SUMMARY = 1 << 3
F_OUT_HASH = 1 << 4
F_OUT_SUMMARY = 1 << 5
# torch rejected the call before giving its backend any work (mismatched dtypes, a peer
# outside the group): the complete record closes the entry and carries nothing to compare
F_REJECTED = 1 << 6

NO_ROOT = -1

# A record's call site: "path:line function", or where the first frame outside torch lies in
# a framework, that frame and the user's own joined by SITE_SEP (see rank/callsite.py).
SITE_SEP = " ← "

# Record phases: an entry record (metadata only) is sent when a rank enters a collective, so
# the collector knows who joined before anything completes; the complete record follows.
PHASE_COMPLETE, PHASE_ENTRY = 0, 1

REC_DTYPE = np.dtype(
    [
        ("group", "<u4"),  # index into Envelope.groups
        ("seq", "<u8"),  # per-group sequence number
        ("op", "<u4"),  # string index
        ("dtype", "<u4"),  # string index
        ("redop", "<u4"),  # string index ("" when the op does not reduce)
        ("algo", "<u4"),  # string index: hash algorithm that produced the hashes
        ("callsite", "<u4"),  # string index
        ("root", "<i4"),  # global rank of root/src/dst, NO_ROOT if none
        ("flags", "<u4"),
        ("numel_in", "<u8"),
        ("numel_out", "<u8"),
        ("phase", "u1"),  # PHASE_COMPLETE or PHASE_ENTRY
        ("peer", "<i4"),  # point-to-point: the other end's global rank, else -1
        ("shape_off", "<u4"),  # into the shapes array: in dims, out dims, in splits, out splits
        ("in_ndim", "u1"),
        ("out_ndim", "u1"),
        ("in_splits_n", "<u2"),
        ("out_splits_n", "<u2"),
        ("step", "<i8"),
        ("t_enter", "<f8"),
        ("t_exit", "<f8"),
        ("t_done", "<f8"),
        ("in_h0", "<u8"),
        ("in_h1", "<u8"),
        ("out_h0", "<u8"),
        ("out_h1", "<u8"),
        ("in_sum", "<f8"),
        ("in_absmax", "<f8"),
        ("in_nan", "<u8"),
        ("in_inf", "<u8"),
        ("out_sum", "<f8"),
        ("out_absmax", "<f8"),
        ("out_nan", "<u8"),
        ("out_inf", "<u8"),
        ("chunk_off", "<u4"),
        ("chunk_n", "<u4"),
    ]
)

# A chunk is the part of one side exchanged with one other rank. ``index`` is that rank's
# global rank: for an input chunk, where it is sent; for an output chunk, where it came
# from. A side that goes to (or comes from) a single rank is one chunk with that owner.
SIDE_IN, SIDE_OUT = 0, 1
CHUNK_DTYPE = np.dtype(
    [
        ("side", "u1"),
        ("index", "<u4"),  # global rank of the counterpart (see above)
        ("h0", "<u8"),
        ("h1", "<u8"),
        ("sum", "<f8"),
    ]
)


class WireError(ValueError):
    """A message that is not a valid commcheck batch; ``reason`` is a short counter key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class RankStatus(msgspec.Struct, omit_defaults=True):
    """What a relay sees of one rank on its node (a ``status`` message carries a list).

    ``state``: alive (running or sleeping), stopped (SIGSTOP, a debugger) or gone (exited,
    or a zombie); ``proc``: the ``/proc/<pid>/stat`` state letter ("" once gone);
    ``goodbye``: the rank said goodbye (a clean exit); ``idle``: seconds since the rank last
    wrote a record; ``exit_code`` / ``signal``: how it ended, when the relay saw it (-1 and
    0 otherwise); ``records`` / ``dropped``: written to its ring, and dropped there;
    ``unreachable`` / ``outages`` / ``resent``: the relay's link to the collector (an
    outage is in the report, not only in a counter). Fields a collector does not know are
    ignored by it.
    """

    rank: int
    pid: int
    state: str
    proc: str = ""
    goodbye: bool = False
    idle: float = 0.0
    exit_code: int = -1
    signal: int = 0
    records: int = 0
    dropped: int = 0
    unreachable: float = 0.0  # seconds the relay could not reach the collector (outages)
    outages: int = 0  # how many times (no ack for max(5 s, 2 x ack_timeout) while messages waited)
    resent: int = 0  # messages of this rank the relay sent again (no ack in time)


class DropRange(msgspec.Struct, array_like=True):
    """Records a rank dropped (its ring was full): those of ``phase`` (``PHASE_ENTRY`` or
    ``PHASE_COMPLETE``) for seqs ``first``..``last`` (inclusive) of group (``group``,
    ``ranks``). A ``records`` message without records carries them (``Envelope.drops``),
    so a collector that does not know the field ignores it; the engine marks those
    collectives "not verified" instead of blaming the rank for them."""

    group: str
    ranks: list[int]
    phase: int
    first: int
    last: int


MAX_DROP_RANGES = 1 << 12  # in one message


class CallFailure(msgspec.Struct, array_like=True):
    """A collective whose real call raised after torch accepted it (its backend had work:
    a peer died under it, a timeout, an NCCL error): ``error`` is the exception's type and
    the first line of its message, at most ``MAX_ERROR_LEN`` characters. A ``records``
    message without records carries them (``Envelope.failed``), as it does drops, so a
    collector that does not know the field ignores it; the report then says the rank
    crashed in that collective with that error instead of waiting in it."""

    group: str
    ranks: list[int]
    seq: int
    op: str
    error: str


MAX_FAILURES = 64  # in one message
MAX_ERROR_LEN = 200


# Ending.how: the script ran to its end (or sys.exit), an exception nobody caught ended it,
# or a stop signal it handled (SIGINT as KeyboardInterrupt, a handler that exits)
END_EXIT, END_EXCEPTION, END_SIGNAL = "exit", "exception", "signal"
ENDINGS = (END_EXIT, END_EXCEPTION, END_SIGNAL)


class Ending(msgspec.Struct, array_like=True):
    """How a rank's process is ending, as its goodbye says (``Envelope.ending``; a goodbye
    without one is from an older commcheck). An exception still runs the exit handlers, so
    a goodbye alone does not say training succeeded (docs/report-status.md). ``code``: the
    exit status given to ``sys.exit``, -1 where not known (the script's end, a goodbye said
    at ``destroy_process_group`` before the process ends); ``signal``: the stop
    signal (SIGTERM, SIGINT, SIGHUP) the process got, 0 if none; ``error``: the uncaught
    exception's type and the first line of its message (at most ``MAX_ERROR_LEN``);
    ``thread``: the same for the first exception that ended another thread (the process
    went on)."""

    how: str
    code: int = -1
    signal: int = 0
    error: str = ""
    thread: str = ""

    @property
    def failed(self) -> bool:
        """Training did not end well: an exception, a non-zero exit status, a signal."""
        return self.how != END_EXIT or self.code > 0 or self.signal > 0


class Envelope(msgspec.Struct, omit_defaults=True):
    """One message. ``seq`` numbers a rank's messages so a receiver can spot gaps."""

    v: int
    kind: str
    run: str
    rank: int
    host: str
    seq: int
    world: int = 0
    pid: int = 0
    node: int = -1
    t: float = 0.0
    strings: list[str] = []
    groups: list[tuple[str, list[int]]] = []
    records: bytes = b""
    chunks: bytes = b""
    shapes: bytes = b""
    counters: dict[str, int] = {}
    status: list[RankStatus] = []
    drops: list[DropRange] = []
    failed: list[CallFailure] = []
    ending: Ending | None = None  # a goodbye's: how the process is ending


class _Received(Envelope, omit_defaults=True):
    """An Envelope as decoded: each group's ranks left as msgpack bytes, which
    :func:`_groups` turns into lists (a 1,000-rank group's list, in every batch, was most
    of the envelope's decoding time). It is an Envelope, with ``groups`` typed as one."""

    groups: list[tuple[str, msgspec.Raw]] = []  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Received)
_ranks_decoder = msgspec.msgpack.Decoder(list[int])


def encode(env: Envelope) -> bytes:
    return _encoder.encode(env)


@dataclass(frozen=True)
class Chunk:
    side: int
    index: int
    h0: int
    h1: int
    sum: float = 0.0


@dataclass
class Record:
    """One collective call as the rank side builds it; columnarised by :class:`BatchBuilder`."""

    group_name: str
    group_ranks: tuple[int, ...]
    seq: int
    op: str
    dtype: str
    redop: str = ""
    root: int = NO_ROOT
    algo: str = ""
    callsite: str = ""
    flags: int = 0
    numel_in: int = 0
    numel_out: int = 0
    in_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    step: int = 0
    t_enter: float = 0.0
    t_exit: float = 0.0
    t_done: float = 0.0
    in_hash: tuple[int, int] = (0, 0)
    out_hash: tuple[int, int] = (0, 0)
    in_summary: tuple[float, float, int, int] = (0.0, 0.0, 0, 0)
    out_summary: tuple[float, float, int, int] = (0.0, 0.0, 0, 0)
    chunks: list[Chunk] = field(default_factory=list)
    phase: int = PHASE_COMPLETE
    peer: int = -1
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()


class BatchBuilder:
    """Turns :class:`Record` objects into one columnar ``records`` envelope."""

    def __init__(self, run: str, rank: int, host: str, world: int, node: int = -1):
        self.run, self.rank, self.host, self.world, self.node = run, rank, host, world, node

    def build(self, records: list[Record], seq: int, t: float = 0.0,
              counters: dict[str, int] | None = None) -> Envelope:
        strings: dict[str, int] = {"": 0}
        groups: dict[tuple[str, tuple[int, ...]], int] = {}

        def s(x: str) -> int:
            i = strings.get(x)
            if i is None:
                i = strings[x] = len(strings)
            return i

        rec = np.zeros(len(records), dtype=REC_DTYPE)
        chunks: list[tuple] = []
        shapes: list[int] = []
        for i, r in enumerate(records):
            gkey = (r.group_name, r.group_ranks)
            g = groups.get(gkey)
            if g is None:
                g = groups[gkey] = len(groups)
            rec[i] = (
                g, r.seq, s(r.op), s(r.dtype), s(r.redop), s(r.algo), s(r.callsite), r.root,
                r.flags, r.numel_in, r.numel_out, r.phase, r.peer, len(shapes),
                len(r.in_shape), len(r.out_shape), len(r.in_splits), len(r.out_splits),
                r.step, r.t_enter, r.t_exit, r.t_done,
                r.in_hash[0], r.in_hash[1], r.out_hash[0], r.out_hash[1],
                *r.in_summary, *r.out_summary, len(chunks), len(r.chunks),
            )
            shapes.extend(r.in_shape)
            shapes.extend(r.out_shape)
            shapes.extend(r.in_splits)
            shapes.extend(r.out_splits)
            chunks.extend((c.side, c.index, c.h0, c.h1, c.sum) for c in r.chunks)
        return Envelope(
            v=WIRE_VERSION, kind=RECORDS, run=self.run, rank=self.rank, host=self.host,
            seq=seq, world=self.world, node=self.node, t=t, strings=list(strings),
            groups=[(name, list(ranks)) for name, ranks in groups],
            records=rec.tobytes(), chunks=np.array(chunks, dtype=CHUNK_DTYPE).tobytes(),
            shapes=np.asarray(shapes, dtype="<i8").tobytes(), counters=counters or {},
        )

    def build_rows(self, rows: list[list], seq: int, t: float = 0.0,
                   counters: dict[str, int] | None = None) -> Envelope:
        """:meth:`build` for records given as the values of their fields in
        :class:`Record`'s order, chunks as ``(side, index, h0, h1, sum)`` sequences: how a
        ring entry holds one (:mod:`commcheck.wire.ring`), so the relay builds a batch
        without a Python object per record or chunk. The same envelope as :meth:`build`."""
        strings: dict[str, int] = {"": 0}
        groups: dict[tuple[str, tuple[int, ...]], int] = {}
        out: list[tuple] = []
        chunks: list[tuple] = []
        shapes: list[int] = []
        s = strings.setdefault  # s(x, len(strings)): x's index, a new one if x is new
        # (group, op, dtype, redop, algo, call site) -> their indices: a batch's records
        # repeat a few of these, so one look-up a record instead of six
        seen: dict[tuple, tuple[int, int, int, int, int, int]] = {}

        for (gname, granks, rseq, op, dtype, redop, root, algo, site, flags, n_in, n_out,
             in_shape, out_shape, step, t_enter, t_exit, t_done, in_hash, out_hash, in_sum,
             out_sum, rchunks, phase, peer, in_splits, out_splits) in rows:
            key = (gname, tuple(granks), op, dtype, redop, algo, site)
            ix = seen.get(key)
            if ix is None:
                g = groups.get(key[:2])
                if g is None:
                    g = groups[key[:2]] = len(groups)
                ix = seen[key] = (g, s(op, len(strings)), s(dtype, len(strings)),
                                  s(redop, len(strings)), s(algo, len(strings)),
                                  s(site, len(strings)))
            g, i_op, i_dtype, i_redop, i_algo, i_site = ix
            out.append((
                g, rseq, i_op, i_dtype, i_redop, i_algo, i_site, root, flags, n_in, n_out,
                phase, peer, len(shapes), len(in_shape), len(out_shape), len(in_splits),
                len(out_splits), step, t_enter, t_exit, t_done, in_hash[0], in_hash[1],
                out_hash[0], out_hash[1], *in_sum, *out_sum, len(chunks), len(rchunks)))
            shapes += in_shape
            shapes += out_shape
            shapes += in_splits
            shapes += out_splits
            if rchunks:
                chunks += map(tuple, rchunks)
        return Envelope(
            v=WIRE_VERSION, kind=RECORDS, run=self.run, rank=self.rank, host=self.host,
            seq=seq, world=self.world, node=self.node, t=t, strings=list(strings),
            groups=[(name, list(ranks)) for name, ranks in groups],
            records=np.array(out, dtype=REC_DTYPE).tobytes(),
            chunks=np.array(chunks, dtype=CHUNK_DTYPE).tobytes(),
            shapes=np.asarray(shapes, dtype="<i8").tobytes(), counters=counters or {},
        )

    def control(self, kind: str, seq: int, t: float = 0.0, pid: int = 0,
                counters: dict[str, int] | None = None) -> Envelope:
        return Envelope(v=WIRE_VERSION, kind=kind, run=self.run, rank=self.rank,
                        host=self.host, seq=seq, world=self.world, node=self.node, t=t,
                        pid=pid, counters=counters or {})

    def status(self, seq: int, t: float, pid: int, ranks: list[RankStatus]) -> Envelope:
        """A relay's status message (``pid``: the relay's; ``rank``: a rank it serves)."""
        return Envelope(v=WIRE_VERSION, kind=STATUS, run=self.run, rank=self.rank,
                        host=self.host, seq=seq, world=self.world, node=self.node, t=t,
                        pid=pid, status=ranks)


@dataclass
class Batch:
    """A decoded, validated message with its columnar arrays (no per-record objects)."""

    env: Envelope
    records: np.ndarray
    chunks: np.ndarray
    shapes: np.ndarray

    @property
    def strings(self) -> list[str]:
        return self.env.strings

    def ints(self, row: np.void | np.ndarray) -> tuple[tuple[int, ...], ...]:
        """(input shape, output shape, input split sizes, output split sizes) of a row."""
        off = int(row["shape_off"])
        out = []
        for n in (row["in_ndim"], row["out_ndim"], row["in_splits_n"], row["out_splits_n"]):
            out.append(tuple(int(x) for x in self.shapes[off:off + int(n)]))
            off += int(n)
        return tuple(out)

    def shape(self, row: np.void | np.ndarray, side: int) -> tuple[int, ...]:
        return self.ints(row)[0 if side == SIDE_IN else 1]


def combine_hashes(hashes: list[tuple[int, int]]) -> tuple[int, int]:
    """The hash of a chunked side: xxh3-128 over its chunks' (h0, h1) in rank order. The
    engine relies on it too: an all_gather's output hash is this over the members' inputs."""
    h = xxhash.xxh3_128_intdigest(np.asarray(hashes, dtype="<u8").tobytes())
    return h & ((1 << 64) - 1), h >> 64


def _frombuffer(buf: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    if len(buf) % dtype.itemsize:
        raise WireError("bad_size", f"{what}: {len(buf)} bytes is not a multiple of "
                                    f"{dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype)


def decode(data: bytes | memoryview) -> Batch:
    """Decode and validate one message; raise :class:`WireError` with a counter reason."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError("too_large", f"message of {len(data)} bytes exceeds the limit")
    try:
        env = _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise WireError("bad_schema", f"schema violation: {e}") from None
    except msgspec.DecodeError as e:
        raise WireError("malformed", f"not a msgpack envelope: {e}") from None
    if env.v != WIRE_VERSION:
        raise WireError("bad_version", f"wire version {env.v}, this collector speaks "
                                       f"{WIRE_VERSION}")
    if env.kind not in KINDS:
        raise WireError("bad_kind", f"unknown message kind {env.kind!r}")
    if env.rank < 0 or env.seq < 0 or env.world < 0:
        raise WireError("bad_field", "negative rank, seq or world size")
    if env.world > MAX_WORLD:
        raise WireError("bad_field", f"world size {env.world} above {MAX_WORLD}")
    if env.world and env.rank >= env.world:
        raise WireError("bad_field", f"rank {env.rank} outside world of {env.world}")
    if len(env.strings) > MAX_STRINGS or any(len(x) > MAX_STRING_LEN for x in env.strings):
        raise WireError("bad_strings", "string table too large")
    rec = _frombuffer(env.records, REC_DTYPE, "records")
    chunks = _frombuffer(env.chunks, CHUNK_DTYPE, "chunks")
    shapes = _frombuffer(env.shapes, np.dtype("<i8"), "shapes")
    if len(rec) > MAX_RECORDS_PER_BATCH:
        raise WireError("too_large", f"{len(rec)} records in one batch")
    if len(rec):
        if env.kind != RECORDS:
            raise WireError("bad_kind", f"{env.kind} message carries records")
        n_str = len(env.strings)
        if int(_string_columns(rec).max()) >= n_str:  # one reduction over the five columns
            for col in _STRING_COLUMNS:
                if int(rec[col].max()) >= n_str:
                    raise WireError("bad_index", f"records.{col} points past the string table")
        if int(rec["group"].max()) >= len(env.groups):
            raise WireError("bad_index", "records.group points past the group table")
        if int((rec["chunk_off"].astype(np.int64) + rec["chunk_n"]).max()) > len(chunks):
            raise WireError("bad_index", "records point past the chunk table")
        ends = rec["shape_off"].astype(np.int64) + rec["in_ndim"] + rec["out_ndim"] + \
            rec["in_splits_n"] + rec["out_splits_n"]
        if int(ends.max()) > len(shapes):
            raise WireError("bad_index", "records point past the shape table")
    if env.kind == STATUS or env.status:
        _check_status(env)
    if env.drops:
        _check_drops(env)
    if env.failed:
        _check_failed(env)
    if env.ending is not None:
        _check_ending(env)
    env.groups = _groups(env)
    return Batch(env, rec, chunks, shapes)


def _groups(env: Envelope) -> list[tuple[str, list[int]]]:
    """The envelope's groups with their rank lists decoded and checked (sorted, unique,
    >= 0, holding the sender), each a list of its own."""
    out = []
    for name, raw in env.groups:
        body = bytes(raw)
        ranks = _VALID_GROUPS.get(body)
        if ranks is None:
            try:
                got = _ranks_decoder.decode(body)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                raise WireError("bad_schema", f"schema violation: {e} (the ranks of group "
                                              f"{name!r})") from None
            if not got or got != sorted(set(got)) or got[0] < 0:
                raise WireError("bad_group", f"group {name!r} has invalid ranks")
            if len(_VALID_GROUPS) >= MAX_VALID_GROUPS:
                _VALID_GROUPS.clear()
            ranks = _VALID_GROUPS[body] = tuple(got)  # immutable: nobody can change it
        i = bisect_left(ranks, env.rank)
        if i == len(ranks) or ranks[i] != env.rank:
            raise WireError("bad_group", f"rank {env.rank} is not a member of group {name!r}")
        out.append((name, list(ranks)))
    return out


def _check_status(env: Envelope) -> None:
    if env.kind != STATUS:
        raise WireError("bad_kind", f"{env.kind} message carries a status")
    if not env.status or len(env.status) > MAX_STATUS:
        raise WireError("bad_status", f"status message with {len(env.status)} ranks")
    if env.records or env.groups:
        raise WireError("bad_status", "status message carries records")
    for s in env.status:
        if s.rank < 0 or (env.world and s.rank >= env.world):
            raise WireError("bad_status", f"status of rank {s.rank} outside the world")
        if s.pid <= 0 or s.state not in STATES or len(s.proc) > 1:
            raise WireError("bad_status", f"status of rank {s.rank}: bad pid or state")
        if not 0.0 <= s.idle < 1e9 or not -1 <= s.exit_code <= 255 or \
                not 0 <= s.signal < 128 or s.records < 0 or s.dropped < 0 or \
                not 0.0 <= s.unreachable < 1e9 or s.outages < 0 or s.resent < 0:
            raise WireError("bad_status", f"status of rank {s.rank}: a field out of range")


def _check_drops(env: Envelope) -> None:
    if env.kind != RECORDS or len(env.drops) > MAX_DROP_RANGES:
        raise WireError("bad_drops", f"{env.kind} message with {len(env.drops)} drop ranges")
    for d in env.drops:
        if d.phase not in (PHASE_COMPLETE, PHASE_ENTRY) or not 0 <= d.first <= d.last or \
                not d.ranks or d.ranks != sorted(set(d.ranks)) or d.ranks[0] < 0 or \
                len(d.group) > MAX_STRING_LEN or env.rank not in d.ranks:
            raise WireError("bad_drops", f"drop range {d.group!r} {d.first}..{d.last} is "
                                         "invalid")


def _check_failed(env: Envelope) -> None:
    if env.kind != RECORDS or len(env.failed) > MAX_FAILURES:
        raise WireError("bad_failed", f"{env.kind} message with {len(env.failed)} failures")
    for f in env.failed:
        if f.seq < 0 or len(f.error) > MAX_ERROR_LEN or len(f.op) > MAX_STRING_LEN or \
                len(f.group) > MAX_STRING_LEN or not f.ranks or min(f.ranks) < 0 or \
                env.rank not in f.ranks:
            raise WireError("bad_failed", f"failure {f.group!r} seq {f.seq} is invalid")


def _check_ending(env: Envelope) -> None:
    e = env.ending
    if env.kind != GOODBYE or e is None or e.how not in ENDINGS or \
            not -1 <= e.code <= 255 or not 0 <= e.signal < 128 or \
            len(e.error) > MAX_ERROR_LEN or len(e.thread) > MAX_ERROR_LEN:
        raise WireError("bad_ending", f"{env.kind} message with an invalid ending")


# Group rank lists seen valid (sorted, unique, >= 0), by their msgpack bytes: every batch
# repeats its sender's groups, and decoding a 1,000-rank list costs ~25 us, sorting it ~20.
_VALID_GROUPS: dict[bytes, tuple[int, ...]] = {}
MAX_VALID_GROUPS = 1 << 14
_STRING_COLUMNS = ("op", "dtype", "redop", "algo", "callsite")
_STR_START = REC_DTYPE.fields["op"][1]
_STR_END = REC_DTYPE.fields["callsite"][1] + 4
assert [REC_DTYPE.fields[c][1] for c in _STRING_COLUMNS] == list(range(_STR_START, _STR_END, 4))


def _string_columns(rec: np.ndarray) -> np.ndarray:
    """The five consecutive uint32 string-index columns as one (n, 5) view."""
    raw = rec.view(np.uint8).reshape(len(rec), REC_DTYPE.itemsize)
    return raw[:, _STR_START:_STR_END].view("<u4")


def try_decode(data: bytes | memoryview) -> Batch | WireError:
    """:func:`decode`, with the rejection as a value: a message is decoded once and its
    outcome handed on (deduplication needs the envelope, the engine the batch)."""
    try:
        return decode(data)
    except WireError as e:
        return e


Decoded = tuple[bytes, "Batch | WireError"]  # a message and the outcome of decoding it


# Dump files: a magic line, then length-prefixed encoded envelopes (the wire format itself).
DUMP_MAGIC = b"COMMCHECK-WIRE\n"
_LEN = struct.Struct("<I")


def write_frame(f: BinaryIO, payload: bytes) -> None:
    f.write(_LEN.pack(len(payload)))
    f.write(payload)


def read_frames(f: BinaryIO) -> Iterator[bytes]:
    """Yield the payloads of a dump file; raise :class:`WireError` on a bad header or tail."""
    if f.read(len(DUMP_MAGIC)) != DUMP_MAGIC:
        raise WireError("bad_file", "not a commcheck dump file (bad magic)")
    while True:
        head = f.read(_LEN.size)
        if not head:
            return
        if len(head) < _LEN.size:
            raise WireError("truncated", "dump file ends inside a frame header")
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE_BYTES:
            raise WireError("too_large", f"frame of {n} bytes exceeds the limit")
        payload = f.read(n)
        if len(payload) < n:
            raise WireError("truncated", "dump file ends inside a frame")
        yield payload
