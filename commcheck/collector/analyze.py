"""Offline analysis: messages in the wire format → the same engine and report.

Sources (any number, merged into one analysis):

* dump files (``*.ccw``, written with ``COMMCHECK_DUMP_DIR``), spill files (``*.spill``,
  left by relays whose collector never came back) and ring files (``*.ring``, left in
  ``/dev/shm`` by ranks whose records no relay delivered: the messages journaled there
  keep their names, the rest are numbered on as the relay would have), or directories
  searched for all three;
* collector databases (SQLite, recognised by their header). One written by an unsharded
  collector is *continued*: the analysis starts from its engine as of its last commit
  (the snapshot), with its findings, stored records and rejection counts, and the messages
  it acknowledged (named in ``delivered``) are skipped in the other sources; at most one
  such database per analysis. One written by a sharded collector holds K engines, which
  one analysis cannot continue: it is read from the message bodies ``--keep-bodies`` kept
  in its ``delivered`` table, like a dump file, and refused without them.

All messages are merged in send-time order (``Envelope.t``; a dump file and one sender's
messages in a database already are, a spill file is sorted), so the engine sees batches in
roughly the order a live collector would have. A message is named by
``(run, rank, pid, seq)``; one seen before (the same message in the database and in a spill
file, or in two copies of a file) is dropped and counted as the rejection ``duplicate``.
A damaged dump or spill file costs only its damaged tail: the frames before it are used and
the damage is counted as a rejection. A damaged ring costs only its damaged entries, each
counted as the rejection ``damaged`` (a ring whose header or size was off also counts once as
``damaged_file``), and a ring file that cannot be read at all as ``bad_file``: each with one
line naming the file (``warn``; docs/security.md). A damaged database is an error.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import os
import sqlite3
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..engine import DEFAULT_HANG_TIMEOUT, Engine
from ..wire import DUMP_MAGIC, Batch, WireError, decode, read_frames
from ..wire.ring import RING_MAGIC, RING_SUFFIX, RingError
from ..wire.salvage import Damage, leftover_messages, open_ring
from .pipeline import Pipeline
from .snapshot import SnapshotError
from .store import Store, StoreError, check_schema

DUMP_SUFFIX = ".ccw"
SPILL_SUFFIX = ".spill"
SQLITE_MAGIC = b"SQLite format 3\x00"
DUMP, SPILL, DB, RING = "dump", "spill", "db", "ring"
FOREIGN = "foreign"  # a file or folder found in a directory that is not the user's: skipped
DUPLICATE = "duplicate"  # rejection reason of a message analysed already
DAMAGED, DAMAGED_FILE = "damaged", "damaged_file"  # ring entries lost; rings whose header was off
NOT_OURS = "not_ours"  # rejection reason of a FOREIGN source (one per file or folder)


class AnalyzeError(Exception):
    pass


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # DUMP, SPILL, DB, RING, or FOREIGN (skipped)
    why: str = ""  # FOREIGN: the line that says whose it is
    mine: bool = False  # found in a directory: read only if it is still ours once opened


Roots = str | Path | Source | Iterable[str | Path | Source]


def _as_list(roots: Roots) -> list[str | Path | Source]:
    return [roots] if isinstance(roots, str | Path | Source) else list(roots)


def _file_kind(p: Path, shown: str | Path) -> str:
    with open(p, "rb") as f:
        head = f.read(max(len(DUMP_MAGIC), len(SQLITE_MAGIC)))
    if head.startswith(DUMP_MAGIC):
        return SPILL if p.suffix == SPILL_SUFFIX else DUMP
    if head.startswith(SQLITE_MAGIC):
        _check_db(p, shown)
        return DB
    if head.startswith(RING_MAGIC):
        return RING
    raise AnalyzeError(f"{shown}: not a commcheck dump file (nor a collector database)")


def find_sources(roots: Roots) -> list[Source]:
    """The sources named by ``roots`` (files or directories), each file once."""
    out: list[Source] = []
    seen: set[Path] = set()
    for root in _as_list(roots):
        if isinstance(root, Source):  # found before
            if root.path.resolve() not in seen:
                seen.add(root.path.resolve())
                out.append(root)
            continue
        p = Path(root)
        if not p.exists():
            raise AnalyzeError(f"{root}: no such file or directory")
        if p.is_file():
            found = [Source(p, _file_kind(p, root))]
        else:
            found = list(_walk(p))
            if not found:
                raise AnalyzeError(f"{root}: no commcheck dump files (*{DUMP_SUFFIX}), "
                                   f"spill files (*{SPILL_SUFFIX}) or ring files "
                                   f"(*{RING_SUFFIX}) found")
        for s in found:
            key = s.path.resolve()
            if key not in seen:
                seen.add(key)
                out.append(s)
    return out


def _walk(root: Path) -> Iterator[Source]:
    """The dump, spill and ring files under ``root``, in name order: only files and
    folders of this user (on a shared node anyone can leave a ``*.ring`` in ``/dev/shm``);
    another user's, or a symlink, is a FOREIGN source that names it. Unreadable folders
    are passed by, as ``rglob`` does."""
    uid = os.getuid()
    kinds = {DUMP_SUFFIX: DUMP, SPILL_SUFFIX: SPILL, RING_SUFFIX: RING}
    todo = [root]
    while todo:
        folder = todo.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        below = []
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            path = Path(e.path)
            if stat.S_ISDIR(st.st_mode):
                if st.st_uid == uid:
                    below.append(path)
                else:
                    yield Source(path, FOREIGN, f"{path}/: a folder of uid {st.st_uid}, not "
                                                f"yours ({uid}): not searched")
                continue
            kind = kinds.get(path.suffix)
            if kind is None:
                continue
            if stat.S_ISLNK(st.st_mode) or st.st_uid != uid:
                whose = "a symlink" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}"
                yield Source(path, FOREIGN, f"{path}: {whose}, not yours ({uid}): not read")
            elif stat.S_ISREG(st.st_mode):
                yield Source(path, kind, mine=True)
        todo.extend(reversed(below))


class _NotYours(PermissionError):
    pass


def _open_source(path: Path, mine: bool) -> BinaryIO:
    """``path`` for reading; ``mine``: refuse (:class:`_NotYours`) a symlink or a file that
    is not the user's, checked on the open file (it may have been swapped since found)."""
    if not mine:
        return open(path, "rb")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _NotYours(f"{path}: now a symlink: not read") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _NotYours(f"{path}: no longer a file of yours: not read")
    return os.fdopen(fd, "rb")


# -- collector databases --------------------------------------------------------------------


def _connect(path: Path) -> sqlite3.Connection:
    """Read-only: the input is evidence, never changed (a WAL left by a killed collector
    is read, not checkpointed)."""
    try:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.OperationalError:
        if Path(f"{path}-wal").exists():
            raise
        # read-only directory, no WAL: nothing uncommitted can be missed
        return sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)


def _check_db(path: Path, shown: str | Path) -> None:
    try:
        conn = _connect(path)
        try:
            tables = {n for (n,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "meta" in tables:
                try:
                    check_schema(shown, dict(conn.execute("SELECT key, value FROM meta")),
                                 read=True)
                except StoreError as e:
                    raise AnalyzeError(str(e)) from None
            if "delivered" not in tables:
                raise AnalyzeError(f"{shown}: SQLite database with no delivered table "
                                   f"(not a commcheck collector database)")
            conn.execute("SELECT run, rank, pid, seq, body FROM delivered LIMIT 1").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise AnalyzeError(f"{shown}: corrupt or unreadable database ({e})") from None


def _db_streams(conn: sqlite3.Connection, path: Path, on_error: Callable[[WireError], None],
                on_bytes: Callable[[int], None]) -> list[Iterator[tuple[float, int, Batch]]]:
    """One stream per sender (run, rank, pid), in ``seq`` order: a sender numbers its
    messages as it sends them, so that is send-time order whatever the arrival order."""
    try:
        senders = conn.execute("SELECT DISTINCT run, rank, pid FROM delivered "
                               "WHERE body IS NOT NULL").fetchall()
    except sqlite3.DatabaseError as e:
        raise AnalyzeError(f"{path}: corrupt database ({e})") from None
    return [_db_sender(conn, path, key, on_error, on_bytes) for key in senders]


def _db_sender(conn: sqlite3.Connection, path: Path, key: tuple,
               on_error: Callable[[WireError], None],
               on_bytes: Callable[[int], None]) -> Iterator[tuple[float, int, Batch]]:
    try:
        rows = conn.execute("SELECT seq, body FROM delivered WHERE run = ? AND rank = ? AND "
                            "pid = ? AND body IS NOT NULL ORDER BY seq", key)
        for seq, body in rows:
            batch = _decoded(body if isinstance(body, bytes) else b"", on_error, on_bytes)
            if batch is not None:
                yield batch.env.t, seq, batch
    except sqlite3.DatabaseError as e:
        raise AnalyzeError(f"{path}: corrupt database ({e})") from None


def _decoded(payload: bytes, on_error: Callable[[WireError], None],
             on_bytes: Callable[[int], None]) -> Batch | None:
    """One stored message, counted as read (with its 4-byte frame) and decoded; None (the
    error reported) when it does not decode."""
    on_bytes(len(payload) + 4)
    try:
        return decode(payload)
    except WireError as e:
        on_error(e)
        return None


def _db_bytes(path: Path) -> int:
    conn = _connect(path)
    try:
        if len(_snapshot_parts(conn, path)) == 1:
            return 0  # continued, not read
        n, size = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(body)), 0) "
                               "FROM delivered WHERE body IS NOT NULL").fetchone()
        return size + 4 * n
    except sqlite3.DatabaseError as e:
        raise AnalyzeError(f"{path}: corrupt database ({e})") from None
    finally:
        conn.close()


# -- dump and spill files -------------------------------------------------------------------


def _batches(path: Path, on_error: Callable[[WireError], None],
             on_bytes: Callable[[int], None],
             on_file_error: Callable[[WireError], None] | None = None, mine: bool = False
             ) -> Iterator[tuple[float, int, Batch]]:
    """(send time, tie-breaker, batch) of each valid frame of one file; ``on_file_error``
    (else ``on_error``) hears of damage that ends the file; ``mine``: found in a
    directory, so read only if it is the user's own."""
    try:
        f = _open_source(path, mine)
    except _NotYours as e:
        on_error(WireError(NOT_OURS, str(e)))
        return
    with f:
        frames = read_frames(f)
        n = 0
        while True:
            try:
                payload = next(frames)
            except StopIteration:
                return
            except WireError as e:
                (on_file_error or on_error)(WireError(e.reason, f"{path}: {e}"))
                return
            batch = _decoded(payload, on_error, on_bytes)
            if batch is not None:
                n += 1
                yield batch.env.t, n, batch


def _sorted_batches(path: Path, on_error: Callable[[WireError], None],
                    on_bytes: Callable[[int], None],
                    on_file_error: Callable[[WireError], None] | None = None,
                    mine: bool = False
                    ) -> Iterator[tuple[float, int, Batch]]:
    """A spill file's batches by send time: it holds them in the order they were put
    there (the outbox's, spilled at exit, after the newer ones that overflowed it). A spill
    file is bounded (``spill_bytes``), so it is read whole."""
    items = [(t, b.env.seq, b) for t, _, b in _batches(path, on_error, on_bytes,
                                                       on_file_error, mine)]
    items.sort(key=lambda x: (x[0], x[1]))
    yield from items


def _ring_batches(path: Path, on_error: Callable[[WireError], None],
                  on_bytes: Callable[[int], None], on_damage: Callable[[Damage], None],
                  mine: bool = False) -> Iterator[tuple[float, int, Batch]]:
    """The messages a ring file left behind (see :func:`commcheck.wire.salvage.leftover_
    messages`), by send time; what damage cost goes to ``on_damage``. A ring the user
    named is read whatever its owner; one found in a directory (``mine``) only if it is
    the user's own (0600, checked once open)."""
    try:
        ring = open_ring(str(path), check_owner=mine)
    except (OSError, RingError) as e:
        on_error(WireError("bad_file", str(e) if str(path) in str(e) else f"{path}: {e}"))
        return
    damage = Damage(str(path), faults=ring.faults)
    try:
        items = []
        for payload in leftover_messages(ring, damage=damage):
            batch = _decoded(payload, on_error, on_bytes)
            if batch is not None:
                items.append((batch.env.t, batch.env.seq, batch))
    finally:
        ring.close()
    if damage.stretches or damage.faults:
        on_damage(damage)
    items.sort(key=lambda x: (x[0], x[1]))
    yield from items


# -- the analysis ---------------------------------------------------------------------------


def _snapshot_parts(conn: sqlite3.Connection, path: Path) -> list[bytes]:
    try:
        return Store(conn).snapshot()
    except sqlite3.DatabaseError as e:
        raise AnalyzeError(f"{path}: corrupt database ({e})") from None


def _check_bodies(conn: sqlite3.Connection, path: Path, parts: list[bytes]) -> None:
    """A database that cannot be continued is read from its bodies: all of them, or none."""
    try:
        missing = conn.execute("SELECT COUNT(*) FROM delivered WHERE body IS NULL"
                               ).fetchone()[0]
    except sqlite3.DatabaseError as e:
        raise AnalyzeError(f"{path}: corrupt database ({e})") from None
    if not missing:
        return
    if parts:
        raise AnalyzeError(f"{path}: written by a collector with --shards {len(parts) - 1}; "
                           f"analyze continues databases of unsharded collectors, or reads "
                           f"the bodies of ones run with --keep-bodies")
    raise AnalyzeError(f"{path}: no engine snapshot and {missing} messages without their "
                       f"bodies; nothing to continue or read")


def _continue_from(conn: sqlite3.Connection, path: Path, parts: list[bytes],
                   pipeline: Pipeline, seen: dict[tuple[str, int, int], set[int]]) -> None:
    """Start from a collector database's last commit: its engine, findings, stored records
    and rejection counts; the messages it acknowledged are marked seen."""
    try:
        pipeline.resume(parts)
    except SnapshotError as e:
        raise AnalyzeError(f"{path}: {e}") from None
    out, source = pipeline.store, Store(conn, name=str(path))
    try:
        out.add_findings(source.findings())
        for table in ("records", "batches"):
            cols = [c for (_, c, *_) in conn.execute(f"PRAGMA table_info({table})")]
            if not cols:
                continue
            marks = ",".join("?" * len(cols))
            out.conn.executemany(f"INSERT INTO {table} VALUES ({marks})",
                                 conn.execute(f"SELECT * FROM {table}"))
        for body in source.frames():  # its records file
            out.add_batch(decode(body), body)
        pipeline.rejected.update(source.rejected())
        for run, rank, pid, seq in conn.execute("SELECT run, rank, pid, seq FROM delivered"):
            seen.setdefault((run, rank, pid), set()).add(seq)
    except (sqlite3.DatabaseError, ValueError) as e:
        raise AnalyzeError(f"{path}: corrupt database ({e})") from None
    except (StoreError, WireError) as e:
        raise AnalyzeError(str(e)) from None


def analyze(roots: Roots, store: Store, hang_timeout: float = DEFAULT_HANG_TIMEOUT,
            progress: Callable[[int], None] | None = None,
            warn: Callable[[str], None] | None = None) -> Pipeline:
    """Feed every message of ``roots`` (dump or spill files, directories of them, collector
    databases), each once, through the engine into ``store``: a fresh engine, or the one a
    collector database left behind (see the module's docstring). ``warn`` gets one line
    per file that was damaged or could not be read."""
    sources = find_sources(roots)
    pipeline = Pipeline(Engine(0, hang_timeout), store)
    advance = progress or (lambda n: None)
    say = warn or (lambda line: None)

    def file_error(e: WireError) -> None:
        pipeline.reject(e)
        say(f"{e} ({e.reason})")

    def damaged(d: Damage) -> None:
        if d.lost:
            pipeline.rejected[DAMAGED] += d.lost
        if d.faults:
            pipeline.rejected[DAMAGED_FILE] += 1
        say(d.line())
    seen: dict[tuple[str, int, int], set[int]] = {}
    continued: Path | None = None
    with contextlib.ExitStack() as stack:
        streams: list[Iterator[tuple[float, int, Batch]]] = []
        for s in sources:
            if s.kind == DB:
                try:
                    conn = _connect(s.path)
                except sqlite3.DatabaseError as e:
                    raise AnalyzeError(f"{s.path}: corrupt or unreadable database ({e})") \
                        from None
                stack.callback(conn.close)
                parts = _snapshot_parts(conn, s.path)
                if len(parts) != 1:  # a sharded collector's (or one that never committed)
                    _check_bodies(conn, s.path, parts)
                    streams += _db_streams(conn, s.path, pipeline.reject, advance)
                    continue
                if continued is not None:
                    raise AnalyzeError(f"{continued} and {s.path}: two collector databases "
                                       f"to continue; analyze one at a time")
                _continue_from(conn, s.path, parts, pipeline, seen)
                continued = s.path
            elif s.kind == FOREIGN:
                pipeline.reject(WireError(NOT_OURS, s.why))
            elif s.kind == SPILL:
                streams.append(_sorted_batches(s.path, pipeline.reject, advance, file_error,
                                               s.mine))
            elif s.kind == RING:
                streams.append(_ring_batches(s.path, file_error, advance, damaged, s.mine))
            else:
                streams.append(_batches(s.path, pipeline.reject, advance, file_error, s.mine))
        last_t = 0.0
        for t, _, batch in heapq.merge(*streams, key=lambda x: (x[0], x[1])):
            env = batch.env
            names = seen.setdefault((env.run, env.rank, env.pid), set())
            if env.seq in names:
                pipeline.reject(WireError(DUPLICATE, f"message {env.seq} of rank {env.rank} "
                                                     f"(pid {env.pid}) seen before"))
                continue
            names.add(env.seq)
            pipeline.feed_batch(batch)
            last_t = max(last_t, t)
    pipeline.close_run(last_t)
    pipeline.persist()
    return pipeline


def total_bytes(roots: Roots) -> int:
    return sum(_db_bytes(s.path) if s.kind == DB else os.path.getsize(s.path)
               for s in find_sources(roots) if s.kind != FOREIGN)
