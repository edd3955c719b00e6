"""The recorded calls of a database, one at a time, for the views that draw them (the
trace, the HTML report's timeline): read from a cursor and one decoded batch at a time,
never gathered whole, whatever the database's ``--records`` mode.

A rank writes two records per call: an *entry* when it enters (so a rank that hangs leaves
one behind) and the *complete* record with its fingerprints. Batches (``file`` and
``batches`` modes) carry the phase. SQL rows (``rows`` mode) do not: there the rows of one
call are read together (ordered by key), the last of several is the complete record, and a
lone row is an entry when it holds no exit or completion time (ranks write entries so).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ..engine.model import group_label
from ..wire import F_ASYNC, F_INJECTED, F_REJECTED, PHASE_ENTRY, Batch, decode
from .store import Store

# Bytes per element of the dtypes records name (wire/ops.py dtype_name); others: unknown.
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16,
    "complex64": 8, "complex32": 4, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}


class Call(NamedTuple):
    """One record of one rank, as the views need it."""

    run: str
    rank: int
    host: str  # "" where the storage does not say (rows: see the ranks table)
    group: str  # group label, as findings name it ("0[0-3]")
    seq: int
    op: str
    dtype: str
    redop: str
    root: int
    peer: int
    callsite: str
    flags: int
    numel_in: int
    numel_out: int
    step: int
    t_enter: float
    t_exit: float
    t_done: float
    entry: bool  # an entry record: the rank entered, this record says nothing of its end

    @property
    def key(self) -> tuple[str, int, str, int]:
        return self.run, self.rank, self.group, self.seq

    @property
    def end(self) -> float:
        """When the call returned (its exit; else its completion), never before its entry."""
        return max(self.t_exit or self.t_done or self.t_enter, self.t_enter)

    @property
    def injected(self) -> bool:
        return bool(self.flags & F_INJECTED)

    @property
    def is_async(self) -> bool:
        return bool(self.flags & F_ASYNC)

    @property
    def rejected(self) -> bool:
        return bool(self.flags & F_REJECTED)


@dataclass(frozen=True)
class Steps:
    """A window of training steps, both ends included; None: open."""

    first: int | None = None
    last: int | None = None

    def holds(self, step: int) -> bool:
        return (self.first is None or step >= self.first) and \
            (self.last is None or step <= self.last)

    def __str__(self) -> str:
        if self.first is None and self.last is None:
            return "all steps"
        return f"steps {'…' if self.first is None else self.first}–" \
               f"{'…' if self.last is None else self.last}"


_ROW_COLUMNS = ("run", "rank", "grp", "seq", "op", "dtype", "redop", "root", "callsite",
                "flags", "numel_in", "numel_out", "step", "t_enter", "t_exit", "t_done")


def calls(store: Store, steps: Steps = Steps()) -> Iterator[Call]:
    """Every record the database kept, within ``steps``: SQL rows first, then batches in
    the order stored."""
    yield from _rows(store, steps)
    for batch in _batches(store):
        yield from batch_calls(batch, steps)


def _batches(store: Store) -> Iterator[Batch]:
    """:meth:`Store.batches`, the ``batches`` table read from a cursor (that method fetches
    its blobs at once, for callers that write while they read)."""
    q = store.conn.execute
    if q("SELECT 1 FROM sqlite_master WHERE name = 'batches'").fetchone():
        for (body,) in q("SELECT body FROM batches ORDER BY rowid"):
            yield decode(body)
    for body in store.frames():
        yield decode(body)


def _rows(store: Store, steps: Steps) -> Iterator[Call]:
    where, params = [], []
    if steps.first is not None:
        where.append("step >= ?")
        params.append(steps.first)
    if steps.last is not None:
        where.append("step <= ?")
        params.append(steps.last)
    cond = f" WHERE {' AND '.join(where)}" if where else ""
    cur = store.conn.execute(f"SELECT {', '.join(_ROW_COLUMNS)} FROM main.records{cond} "
                             f"ORDER BY run, rank, grp, seq, rowid", params)
    held: tuple | None = None
    n = 0  # rows of the held call: of several, the first ones are its entry, the last
    for row in cur:  # one completes it
        if held is not None and held[:4] != row[:4]:
            yield _row_call(held, entry=n == 1 and not (held[14] or held[15]))
            n = 0
        held, n = row, n + 1
    if held is not None:
        yield _row_call(held, entry=n == 1 and not (held[14] or held[15]))


def _row_call(row: tuple, entry: bool) -> Call:
    (run, rank, grp, seq, op, dtype, redop, root, site, flags, n_in, n_out, step, t_enter,
     t_exit, t_done) = row
    return Call(run, rank, "", grp, seq, op, dtype, redop, root, -1, site, flags, n_in, n_out,
                step, t_enter, t_exit, t_done, entry)


def batch_calls(batch: Batch, steps: Steps = Steps()) -> Iterator[Call]:
    """The records of one decoded batch within ``steps``."""
    rec = batch.records
    if not len(rec):
        return
    env, s = batch.env, batch.strings
    if steps.first is not None:
        rec = rec[rec["step"] >= steps.first]
    if steps.last is not None:
        rec = rec[rec["step"] <= steps.last]
    labels = [group_label(name, tuple(ranks)) for name, ranks in env.groups]
    cols = [rec[c].tolist() for c in ("group", "seq", "op", "dtype", "redop", "root", "peer",
                                      "callsite", "flags", "numel_in", "numel_out", "step",
                                      "t_enter", "t_exit", "t_done", "phase")]
    for (g, seq, op, dtype, redop, root, peer, site, flags, n_in, n_out, step, t_enter,
         t_exit, t_done, phase) in zip(*cols, strict=True):
        yield Call(env.run, env.rank, env.host, labels[g], seq, s[op], s[dtype], s[redop],
                   root, peer, s[site], flags, n_in, n_out, step, t_enter, t_exit, t_done,
                   phase == PHASE_ENTRY)


def hosts(store: Store) -> dict[int, str]:
    """Each rank's host as the collector last knew it."""
    return dict(store.conn.execute("SELECT rank, host FROM ranks ORDER BY rank"))
