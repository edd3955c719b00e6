"""``commcheck trace``: a database as Chrome trace-event JSON, for Perfetto and
``chrome://tracing`` (the format the PyTorch profiler writes), so a run's collectives sit
beside the tools people already debug with. See docs/views.md.

One process per host, one thread (track) per rank; every completed call a complete ("X")
slice from entry to exit, with op, group, seq, step, bytes and call site in its args; every
finding an instant event on each culprit's track carrying the report's text; a call a rank
entered and never completed (a hang, a death) a begin ("B") event with no end: the viewers
draw it to the end of the trace, "Did not end".

Written as it is read: events stream to the file from the database's cursor and one
decoded batch at a time; only the entries still waiting for their completion are held.
Times are each rank's own wall clock (``time.time()`` where it recorded), in microseconds
since the epoch, not aligned across hosts: the database keeps no receive times to align by,
and an aligned picture would hide the skew a reader may be looking for.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO

import msgspec

from ..engine import Finding
from ..wire.private import private_output
from .calls import ITEMSIZE, Call, Steps, calls, hosts
from .report import _how_far, _n, _short
from .store import Store

CLOCKS = ("each rank's own wall clock (time.time() where it recorded), microseconds since "
          "the epoch; hosts are not aligned (skew between them shows as offset edges of one "
          "collective)")
NOBODY = (1 << 31) - 1  # pid and tid of the findings with no culprit (no rank has it)
LARGE = 256 << 20  # bytes: chrome://tracing struggles beyond this; Perfetto opens ~2 GB
# A rank's tid: never 0, which Perfetto takes for the idle thread and merges into the
# process's main thread, and never a host's pid (1, 2, ...), which Perfetto would show as
# that process's main thread; its last digits are the rank's.
TID_BASE = 100_000


def tid_of(rank: int) -> int:
    return TID_BASE + rank


class Event(msgspec.Struct, omit_defaults=True):
    """One trace event (the Trace Event Format's JSON object form)."""

    name: str
    ph: str  # X complete, B begin, i instant, M metadata
    pid: int
    tid: int
    ts: float  # microseconds
    dur: float | None = None
    cat: str = ""
    s: str = ""  # instant scope: t thread, g global
    args: dict[str, object] = {}


@dataclass
class TraceStats:
    """What a trace holds: the size line."""

    slices: int = 0
    open: int = 0
    findings: int = 0
    ranks: set[int] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    bytes: int = 0
    steps: Steps = Steps()

    def line(self, path: str) -> str:
        size = f"{self.bytes / 1e6:.1f} MB" if self.bytes >= 100_000 else f"{self.bytes} bytes"
        line = (f"{path}: {size}, {_n(self.slices, 'call')} ({self.open} never completed), "
                f"{_n(self.findings, 'finding')}, {_n(len(self.ranks), 'rank')} on "
                f"{_n(len(self.hosts), 'host')}, {self.steps}")
        if self.bytes > LARGE:
            line += ("; large for chrome://tracing (Perfetto's UI opens up to ~2 GB): "
                     "narrow it with --from/--to")
        return line


class _Writer:
    """Events into an open JSON array, each once, tracks named on first use."""

    def __init__(self, out: BinaryIO, host_of: dict[int, str], stats: TraceStats):
        self.out, self.host_of, self.stats = out, host_of, stats
        self._enc = msgspec.json.Encoder()
        self._pids = {h: i + 1 for i, h in enumerate(sorted(set(host_of.values())))}
        self._named: set[int] = set()
        self._first = True

    def emit(self, e: Event) -> None:
        self.out.write(b"\n" if self._first else b",\n")
        self.out.write(self._enc.encode(e))
        self._first = False

    def track(self, rank: int, host: str = "") -> tuple[int, int]:
        """(pid, tid) of a rank, its host's process and its own thread named the first
        time."""
        host = self.host_of.get(rank) or host or "unknown host"
        pid = self._pids.setdefault(host, len(self._pids) + 1)
        tid = tid_of(rank)
        if pid not in self._named:  # on the rank's own tid: Perfetto splits a tid seen
            self._named.add(pid)        # under two pids into several threads
            self.emit(Event("process_name", "M", pid, tid, 0.0, args={"name": host}))
            self.emit(Event("process_sort_index", "M", pid, tid, 0.0,
                            args={"sort_index": pid}))
        if rank not in self.stats.ranks:
            self.stats.ranks.add(rank)
            self.stats.hosts.add(host)
            self.host_of.setdefault(rank, host)
            self.emit(Event("thread_name", "M", pid, tid, 0.0, args={"name": f"rank {rank}"}))
            self.emit(Event("thread_sort_index", "M", pid, tid, 0.0, args={"sort_index": rank}))
        return pid, tid

    def nobody(self) -> tuple[int, int]:
        """The track of findings with no culprit: a process and thread of their own."""
        if NOBODY not in self._named:
            self._named.add(NOBODY)
            self.emit(Event("process_name", "M", NOBODY, NOBODY, 0.0, args={"name": "run"}))
            self.emit(Event("thread_name", "M", NOBODY, NOBODY, 0.0,
                            args={"name": "findings with no culprit"}))
        return NOBODY, NOBODY


@functools.lru_cache(maxsize=1 << 14)
def _site(callsite: str) -> str:
    """A call site as the report shows it (one frame a line), at most 2000 characters;
    cached: a run has few distinct call sites and many calls."""
    return _short(callsite)[:2000] if callsite else ""


@functools.lru_cache(maxsize=1 << 14)
def _nbytes(dtype: str, numel: int) -> int | str:
    size = ITEMSIZE.get(dtype)
    return f"{numel} elements" if size is None else numel * size


def _args(c: Call) -> dict[str, object]:
    args: dict[str, object] = {"group": c.group, "seq": c.seq, "step": c.step,
                               "bytes_in": _nbytes(c.dtype, c.numel_in),
                               "bytes_out": _nbytes(c.dtype, c.numel_out), "dtype": c.dtype}
    if c.redop:
        args["redop"] = c.redop
    if c.root >= 0:
        args["root"] = c.root
    if c.peer >= 0:
        args["peer"] = c.peer
    args["callsite"] = _site(c.callsite)
    if c.flags:
        if c.is_async:
            args["async"] = True
            if c.t_done > c.t_exit > 0:
                args["done_ms_after_exit"] = (c.t_done - c.t_exit) * 1e3
        if c.injected:
            args["injected"] = True
        if c.rejected:
            args["rejected"] = True
    return args


def _slices(w: _Writer, records: Iterable[Call], goodbye: set[int]) -> None:
    """Complete records as slices; entries held until their completion, and those never
    completed as begin events with no end."""
    waiting: dict[tuple, Call] = {}
    for c in records:
        if c.entry:
            waiting[c.key] = c
            continue
        waiting.pop(c.key, None)
        pid, tid = w.track(c.rank, c.host)
        w.emit(Event(c.op, "X", pid, tid, c.t_enter * 1e6, (c.end - c.t_enter) * 1e6,
                     cat="collective", args=_args(c)))
        w.stats.slices += 1
    for c in sorted(waiting.values(), key=lambda c: (c.rank, c.t_enter)):
        pid, tid = w.track(c.rank, c.host)
        why = ("entered, no completion recorded (the rank said goodbye: its completion "
               "record was lost)" if c.rank in goodbye else
               "entered, never completed: a hang or a death (see the findings)")
        w.emit(Event(f"{c.op} (never completed)", "B", pid, tid, c.t_enter * 1e6,
                     cat="collective,open", args={**_args(c), "open": why}))
        w.stats.open += 1


def _instants(w: _Writer, findings: Iterable[Finding], steps: Steps) -> None:
    """Each finding on each culprit's track, at its time (Finding.t), with its text."""
    for f in findings:
        if not steps.holds(f.step):
            continue
        text = f"{f.kind}{' (ambiguous)' if f.ambiguous else ''}" \
               f"{' (injected)' if f.injected else ''}: {_how_far(f)}"
        args = {"text": text, "op": f.op, "group": f.group, "seq": f.seq, "step": f.step,
                "culprits": f.culprits, "hosts": f.hosts,
                "callsite": _site(f.callsite)}
        name = f"{f.kind}: {f.op} {f.group} seq {f.seq}"
        w.stats.findings += 1
        if not f.culprits:  # nobody to blame (a reduction wrong everywhere): the whole trace
            pid, tid = w.nobody()
            w.emit(Event(name, "i", pid, tid, f.t * 1e6, cat="finding", s="g", args=args))
            continue
        for r in f.culprits:
            pid, tid = w.track(r, f.hosts[0] if len(f.hosts) == 1 else "")
            w.emit(Event(name, "i", pid, tid, f.t * 1e6, cat="finding", s="t", args=args))


def write_trace(store: Store, out: BinaryIO, steps: Steps = Steps()) -> TraceStats:
    """The trace of a database into ``out`` (binary, written sequentially)."""
    stats = TraceStats(steps=steps)
    goodbye = {r for (r,) in store.conn.execute("SELECT rank FROM ranks WHERE goodbye")}
    start = out.tell() if out.seekable() else 0
    out.write(b'{"displayTimeUnit":"ms","otherData":'
              + msgspec.json.encode({"producer": "commcheck trace", "clocks": CLOCKS,
                                     "steps": str(steps)})
              + b',"traceEvents":[')
    w = _Writer(out, hosts(store), stats)
    _slices(w, calls(store, steps), goodbye)
    _instants(w, store.findings(), steps)
    out.write(b"\n]}\n")
    out.flush()
    stats.bytes = (out.tell() - start) if out.seekable() else 0
    return stats


def write_trace_file(store: Store, path: str, steps: Steps = Steps()) -> TraceStats:
    """:func:`write_trace` into a new private file (wire/private.py)."""
    with private_output(path) as out:
        return write_trace(store, out, steps)
