"""SQLite persistence of records, findings, ranks and collector counters.

One file per collector. ``meta`` marks the file as commcheck's and carries the schema
version, so ``collect``, ``report`` and ``analyze`` refuse anything else with one clear line.
Version 2: every commit holds the engine's snapshot, and a restart continues from it; a
version-1 database may predate snapshots (its restart replayed message bodies), so it is
refused rather than half understood. Version 3: records are kept by default in a records
file beside the database (``DB.records``, see :data:`RECORD_MODES`), indexed by the
``record_frames`` table; a version-2 database is still read (report, analyze), but
``collect`` does not continue one, and a version-2 commcheck refuses a version-3 database
(it would miss the records file).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from ..engine import Finding, RankState
from ..engine.findings import LastEntered
from ..engine.model import group_label
from ..wire import DUMP_MAGIC, Batch, Ending, decode, encode
from .file_writer import FileWriter, WriteFailed
from .options import DEFAULT_RECORDS

SCHEMA_VERSION = 3
READABLE_SCHEMAS = (2, 3)  # report and analyze read these; collect continues only its own
MAGIC = "commcheck"
RECORDS_SUFFIX = ".records"
log = logging.getLogger("commcheck")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ranks (
    run TEXT NOT NULL, rank INTEGER NOT NULL, host TEXT, node INTEGER, hello INTEGER,
    goodbye INTEGER, records INTEGER, counters TEXT, last TEXT, PRIMARY KEY (run, rank));
CREATE TABLE IF NOT EXISTS records (
    run TEXT, rank INTEGER, grp TEXT, seq INTEGER, op TEXT, dtype TEXT, redop TEXT,
    root INTEGER, algo TEXT, callsite TEXT, flags INTEGER, numel_in INTEGER,
    numel_out INTEGER, step INTEGER, t_enter REAL, t_exit REAL, t_done REAL,
    in_hash TEXT, out_hash TEXT, in_sum REAL, in_absmax REAL, in_nan INTEGER, in_inf INTEGER,
    out_sum REAL, out_absmax REAL, out_nan INTEGER, out_inf INTEGER, chunks BLOB);
CREATE INDEX IF NOT EXISTS records_key ON records (run, grp, seq);
CREATE TABLE IF NOT EXISTS batches (
    run TEXT, rank INTEGER, seq INTEGER, n INTEGER, body BLOB);
CREATE TABLE IF NOT EXISTS record_frames (
    run TEXT, rank INTEGER, seq INTEGER, n INTEGER, off INTEGER, len INTEGER);
CREATE TABLE IF NOT EXISTS findings (
    id INTEGER PRIMARY KEY, kind TEXT, run TEXT, op TEXT, grp TEXT, seq INTEGER,
    step INTEGER, culprits TEXT, hosts TEXT, callsite TEXT, detail TEXT, ambiguous INTEGER,
    t REAL);
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS snapshot (part INTEGER PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS rank_status (
    run TEXT NOT NULL, rank INTEGER NOT NULL, pid INTEGER, host TEXT, node INTEGER,
    state TEXT, proc TEXT, goodbye INTEGER, idle REAL, exit_code INTEGER, signal INTEGER,
    records INTEGER, dropped INTEGER, relay_pid INTEGER, t REAL, PRIMARY KEY (run, rank));
CREATE TABLE IF NOT EXISTS endings (
    run TEXT NOT NULL, rank INTEGER NOT NULL, how TEXT, code INTEGER, signal INTEGER,
    error TEXT, thread TEXT, PRIMARY KEY (run, rank));
"""

STATUS_COLUMNS = ("run", "rank", "pid", "host", "node", "state", "proc", "goodbye", "idle",
                  "exit_code", "signal", "records", "dropped", "relay_pid", "t")


class StoreError(Exception):
    pass


def _write_failed(e: sqlite3.Error) -> bool:
    """SQLite could not write its files (I/O error, full disk), as opposed to a file that
    is not a database."""
    name = getattr(e, "sqlite_errorname", "")
    return name.startswith("SQLITE_IOERR") or name == "SQLITE_FULL"


def _hold(path: Path) -> int | None:
    """An exclusive flock on the database file while a store writes it: a second writer (a
    collector started again on a --db whose first one still runs) is refused instead of
    interleaving commits and snapshots with it. flock, not SQLite's own locks, so that
    ``report`` and ``trace`` still read the database meanwhile. The descriptor stays open
    until the connection has closed: closing another descriptor of the file would drop the
    POSIX locks SQLite holds on it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # no transaction is open yet: closing drops no SQLite lock
        os.close(fd)
        raise StoreError(f"{path}: another commcheck collect (or analyze) is writing it; "
                         f"stop that one first, or use another --db") from None
    except OSError:  # a file system without flock: written unguarded, as before
        os.close(fd)
        return None
    return fd


def _let_go(lock: int | None) -> None:
    if lock is not None:
        os.close(lock)


def cannot_write(db: str | Path, e: BaseException) -> str:
    """One line for a database or records file the collector can no longer write."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return f"{db}: cannot write ({why}; is its disk full?)"


class RankRow(msgspec.Struct, kw_only=True):
    """One rank as the engine last knew it (the ``ranks`` table)."""

    run: str  # the run it last reported under
    rank: int
    host: str
    node: int
    hello: bool
    goodbye: bool  # it ended its run normally
    records: int
    counters: dict[str, int]  # its own counters (dropped, spilled, not_checked, bypassed:<g>)
    last: LastEntered | None = None  # its last entry; kept for ranks that did not say goodbye
    ending: Ending | None = None  # how its goodbye said it ends (none from older commcheck)


class StoreSummary(msgspec.Struct, kw_only=True):
    """What a database holds besides its findings: the report's summary is built from it."""

    records: int  # records kept (rows and batches)
    findings: int
    runs: list[str]  # run ids of the records kept, sorted
    ranks: list[RankRow]  # by rank
    counters: dict[str, int]  # the collector's (verified, unmatched, rejected.<reason>, ...)


class _Labels:
    """Group labels by group identity: every commit names each rank's last collective, and
    labelling a 1024-rank group (``group_label``) costs ~75 us. The engine keeps one ranks
    tuple per group, so the cache is keyed by its identity (and holds it)."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, int], tuple[tuple[int, ...], str]] = {}

    def at(self, key: tuple) -> str:
        """``Call.at`` of a call with this key."""
        _, name, ranks, seq = key
        hit = self._by.get((name, id(ranks)))
        if hit is None or hit[0] is not ranks:
            if len(self._by) >= 4096:
                self._by.clear()
            hit = self._by[(name, id(ranks))] = (ranks, group_label(name, ranks))
        return f"{hit[1]} seq {seq}"


def _last_entered(state: RankState, labels: _Labels) -> str | None:
    """What a rank that has not said goodbye last entered, as JSON (the report shows it for
    a run that did not finish)."""
    last = state.last
    if last is None:
        return None
    meta = last.meta
    t = meta.t_enter if math.isfinite(meta.t_enter) else 0.0
    return msgspec.json.encode(LastEntered(op=meta.op, at=labels.at(last.key),
                                           callsite=meta.callsite, t=t)).decode()


def _detail_text(f: Finding) -> str:
    return json.dumps(msgspec.to_builtins(f.detail))


def check_schema(path: str | Path, meta: dict[str, str], read: bool = False) -> None:
    """Refuse, with one line, a commcheck database of another schema version (``meta``: its
    meta table); ``read``: to read it (report, analyze), any of :data:`READABLE_SCHEMAS`."""
    found = meta.get("schema")
    if found == str(SCHEMA_VERSION) or (read and found in map(str, READABLE_SCHEMAS)):
        return
    if found is not None and found.isdigit() and int(found) < SCHEMA_VERSION:
        raise StoreError(f"{path}: written by an older commcheck (schema {found}; this one "
                         f"reads {SCHEMA_VERSION}): open it with the commcheck that wrote "
                         f"it, or collect into a new --db")
    raise StoreError(f"{path}: written by a newer commcheck (schema {found}; this one reads "
                     f"{SCHEMA_VERSION})")


# How records are kept (findings, ranks and counters always are):
# * file (the default): each batch's message, as received, appended to ``DB.records`` (a
#   dump file: the wire format's frames, which ``analyze`` reads too), one ``record_frames``
#   row per batch saying where; read back decoded (:meth:`Store.batches`, :meth:`Store.query`,
#   ``commcheck records``). The file is written before each commit and cut back to the
#   committed frames when a collector continues the database, so it holds exactly what
#   was acknowledged.
# * rows: one SQL row per record (queryable in place; ~10x slower than the checks);
# * batches: one row per batch holding the message as a blob (SQLite writes it twice);
# * none.
RECORD_MODES = ("file", "rows", "batches", "none")

RECORD_COLUMNS = (
    "run", "rank", "grp", "seq", "op", "dtype", "redop", "root", "algo", "callsite", "flags",
    "numel_in", "numel_out", "step", "t_enter", "t_exit", "t_done", "in_hash", "out_hash",
    "in_sum", "in_absmax", "in_nan", "in_inf", "out_sum", "out_absmax", "out_nan", "out_inf",
    "chunks")


def records_path(db: str | Path) -> Path:
    """The records file of a database (``file`` mode)."""
    return Path(f"{db}{RECORDS_SUFFIX}")


def _hexes(h0, h1) -> list[str]:
    return [f"{b:016x}{a:016x}" for a, b in zip(h0.tolist(), h1.tolist(), strict=True)]


def record_rows(batch: Batch) -> Iterator[tuple]:
    """A batch's records as rows of the ``records`` table (:data:`RECORD_COLUMNS`)."""
    rec = batch.records
    env, s = batch.env, batch.strings
    labels = [group_label(name, tuple(ranks)) for name, ranks in env.groups]
    chunk_bytes = batch.chunks.tobytes()
    size = batch.chunks.dtype.itemsize
    offs, ns = rec["chunk_off"].tolist(), rec["chunk_n"].tolist()
    cols = [
        [env.run] * len(rec), [env.rank] * len(rec),
        [labels[g] for g in rec["group"].tolist()], rec["seq"].tolist(),
        *([s[i] for i in rec[c].tolist()] for c in ("op", "dtype", "redop")),
        rec["root"].tolist(), [s[i] for i in rec["algo"].tolist()],
        [s[i] for i in rec["callsite"].tolist()],
        *(rec[c].tolist() for c in ("flags", "numel_in", "numel_out", "step", "t_enter",
                                    "t_exit", "t_done")),
        _hexes(rec["in_h0"], rec["in_h1"]), _hexes(rec["out_h0"], rec["out_h1"]),
        *(rec[c].tolist() for c in ("in_sum", "in_absmax", "in_nan", "in_inf", "out_sum",
                                    "out_absmax", "out_nan", "out_inf")),
        [chunk_bytes[o * size:(o + n) * size] for o, n in zip(offs, ns, strict=True)],
    ]
    return zip(*cols, strict=True)


_INSERT_ROWS = f"INSERT INTO main.records VALUES ({','.join('?' * len(RECORD_COLUMNS))})"


class Store:
    def __init__(self, conn: sqlite3.Connection, records: str = DEFAULT_RECORDS,
                 name: str = "database"):
        if records not in RECORD_MODES:
            raise StoreError(f"records mode {records!r}: expected one of "
                             f"{', '.join(RECORD_MODES)}")
        self.conn = conn
        self.records = records
        self.name = name  # the path, for error messages and the records file
        self._file = None  # the records file, open for appending (``file`` mode, writing)
        self._writer: FileWriter | None = None  # appends to it, on its own thread
        self._end = 0  # where the next frame goes
        self._lock: int | None = None  # the writer's flock on the database file (_hold)
        self._frames: list[tuple] = []  # written to the file, not yet in record_frames
        self._labels = _Labels()

    @classmethod
    def create(cls, path: str | Path, records: str = DEFAULT_RECORDS) -> Store:
        p = Path(path)
        if records not in RECORD_MODES:
            raise StoreError(f"records mode {records!r}: expected one of "
                             f"{', '.join(RECORD_MODES)}")
        try:
            if p.parent and not p.parent.exists():
                p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{path}: cannot create its directory ({e.strerror})") from None
        lock = None
        try:
            conn = sqlite3.connect(p, check_same_thread=False)
            tables = {n for (n,) in conn.execute("SELECT name FROM sqlite_master")}
            if tables and "meta" not in tables:  # someone else's database: leave it alone
                conn.close()
                raise StoreError(f"{path}: not a commcheck database")
            try:
                lock = _hold(p)
            except StoreError:
                conn.close()
                raise
            existing = dict(conn.execute("SELECT key, value FROM meta")) if tables else {}
            if existing:  # checked before anything is written to it
                try:
                    if existing.get("magic") != MAGIC:
                        raise StoreError(f"{path}: not a commcheck database")
                    check_schema(path, existing)
                except StoreError:
                    conn.close()
                    _let_go(lock)
                    raise
            # WAL with synchronous=NORMAL: a commit survives the collector being killed
            # (the rule the delivery acks rely on); only a power loss or kernel crash of
            # the head node can take back the last commits, and that ends the job anyway.
            if not tables:  # large pages: message bodies are blobs of ~50-200 KiB
                conn.execute("PRAGMA page_size=65536")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            _let_go(lock)
            if _write_failed(e):
                raise StoreError(cannot_write(path, e)) from None
            if getattr(e, "sqlite_errorname", "") == "SQLITE_CANTOPEN":
                raise StoreError(f"{path}: cannot open or create it ({e})") from None
            raise StoreError(f"{path}: not a usable SQLite database ({e})") from None
        conn.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)",
                         [("magic", MAGIC), ("schema", str(SCHEMA_VERSION)),
                          ("created", str(time.time()))])
        conn.commit()
        store = cls(conn, records, str(path))
        store._lock = lock
        if records == "file":
            try:
                store._open_file()
            except BaseException:
                conn.close()
                _let_go(lock)
                raise
        return store

    @classmethod
    def open(cls, path: str | Path) -> Store:
        """Open an existing commcheck database read-only."""
        p = Path(path)
        if not p.is_file():
            raise StoreError(f"{path}: no such file")
        try:
            conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
            meta = dict(conn.execute("SELECT key, value FROM meta"))
        except sqlite3.DatabaseError:
            raise StoreError(f"{path}: not a commcheck database") from None
        if meta.get("magic") != MAGIC:
            raise StoreError(f"{path}: not a commcheck database")
        check_schema(path, meta, read=True)
        return cls(conn, name=str(path))

    def _open_file(self) -> None:
        """Open the records file for appending, cut back to the frames committed (what
        follows was not acknowledged: its senders send it again). Frames the file lost (a
        power loss took back writes the database kept) are dropped from the index, with a
        warning."""
        path = records_path(self.name)
        q = self.conn.execute
        end = q("SELECT COALESCE(MAX(off + len), 0) FROM record_frames").fetchone()[0]
        try:
            f = open(path, "r+b" if path.exists() else "w+b",  # noqa: SIM115 (the store's)
                     buffering=0)
            try:
                head = f.read(len(DUMP_MAGIC))
                if head and head != DUMP_MAGIC:
                    raise StoreError(f"{path}: not a commcheck records file; move it away "
                                     f"or collect into a new --db")
                if not head:
                    f.write(DUMP_MAGIC)
                size = max(os.fstat(f.fileno()).st_size, len(DUMP_MAGIC))
                if size < end:
                    n, frames = q("SELECT COALESCE(SUM(n), 0), COUNT(*) FROM record_frames "
                                  "WHERE off + len > ?", (size,)).fetchone()
                    q("DELETE FROM record_frames WHERE off + len > ?", (size,))
                    self.conn.commit()
                    log.warning("%s: %d records (%d batches) the database committed are not "
                                "in %s (lost with the file's last writes); dropped from its "
                                "index", self.name, n, frames, path)
                    end = q("SELECT COALESCE(MAX(off + len), 0) FROM record_frames"
                            ).fetchone()[0]
                end = max(end, len(DUMP_MAGIC))
                f.truncate(end)
                f.seek(end)
            except BaseException:
                f.close()
                raise
        except OSError as e:
            raise StoreError(f"{path}: cannot open the records file ({e.strerror})") from None
        self._file, self._end = f, end
        self._writer = FileWriter(f.fileno())

    def add_batch(self, batch: Batch, raw: bytes | None = None) -> None:
        """Keep a batch's records; ``raw``, the message it was decoded from, saves
        re-encoding it in ``file`` and ``batches`` modes."""
        rec = batch.records
        if not len(rec) or self.records == "none":
            return
        env = batch.env
        if self.records == "file":
            if self._file is None:
                self._open_file()
            body = raw if raw is not None else encode(env)
            # At once, while the message is in the cache: gathering megabytes of messages
            # for fewer, larger writes cost ~10x the CPU (their memory is given back to the
            # OS and faulted in again, and the copies come from DRAM). On the writer's
            # thread: the kernel's copy runs beside the engine (file_writer.py).
            self._writer.write([len(body).to_bytes(4, "little"), body])
            self._frames.append((env.run, env.rank, env.seq, len(rec), self._end + 4,
                                 len(body)))
            self._end += 4 + len(body)
            return
        if self.records == "batches":
            self.conn.execute("INSERT INTO batches VALUES (?,?,?,?,?)",
                              (env.run, env.rank, env.seq, len(rec),
                               raw if raw is not None else encode(env)))
            return
        self.conn.executemany(_INSERT_ROWS, record_rows(batch))

    def _index_frames(self) -> None:
        """The frames written since the last commit (each handed to the OS as it came: the
        file is unbuffered) join the index in the transaction about to commit: the index
        never names bytes the file has not been given."""
        if self._frames:
            try:
                self._writer.flush()
            except WriteFailed as e:  # index what is in the file, then fail as before
                self._frames = self._frames[:e.written]
                raise
            finally:
                self.conn.executemany("INSERT INTO record_frames VALUES (?,?,?,?,?,?)",
                                      self._frames)
                self._frames = []

    def add_findings(self, findings: list[Finding]) -> None:
        self.conn.executemany(
            "INSERT INTO findings (kind, run, op, grp, seq, step, culprits, hosts, callsite, "
            "detail, ambiguous, t) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            [(str(f.kind), f.run, f.op, f.group, f.seq, f.step, json.dumps(f.culprits),
              json.dumps(f.hosts), f.callsite, _detail_text(f), int(f.ambiguous), f.t)
             for f in findings])

    def update_finding_detail(self, f: Finding) -> None:
        self.conn.execute("UPDATE findings SET detail = ? WHERE kind = ? AND run = ? AND grp = ? "
                          "AND seq = ? AND culprits = ?", (_detail_text(f), str(f.kind), f.run,
                                                           f.group, f.seq, json.dumps(f.culprits)))

    def set_ranks(self, ranks: dict[int, RankState]) -> None:
        """Mirror the engine's rank table: one row per rank, under the run it last used."""
        self.conn.execute("DELETE FROM ranks")
        self.conn.executemany(
            "INSERT INTO ranks VALUES (?,?,?,?,?,?,?,?,?)",
            [(s.run, r, s.host, s.node, int(s.hello), int(s.goodbye), s.records,
              json.dumps(s.counters), None if s.goodbye else _last_entered(s, self._labels))
             for r, s in ranks.items()])
        self.conn.execute("DELETE FROM endings")
        self.conn.executemany("INSERT INTO endings VALUES (?,?,?,?,?,?,?)",
                              [(s.run, r, *s.ending) for r, s in ranks.items()
                               if s.goodbye and s.ending is not None])

    def set_counters(self, counters: dict[str, int]) -> None:
        self.conn.executemany("INSERT OR REPLACE INTO counters VALUES (?, ?)",
                              list(counters.items()))

    def set_status(self, rows: list[dict]) -> None:
        """The latest relay observation of each rank (``status`` messages), replaced."""
        self.conn.executemany(
            f"INSERT OR REPLACE INTO rank_status VALUES ({','.join('?' * len(STATUS_COLUMNS))})",
            [tuple(row[c] for c in STATUS_COLUMNS) for row in rows])

    def statuses(self) -> list[dict]:
        """What the relays last said about each rank (empty for older databases)."""
        if not self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'rank_status'"
                                 ).fetchone():
            return []
        cols = ", ".join(STATUS_COLUMNS)
        return [dict(zip(STATUS_COLUMNS, row, strict=True)) for row in self.conn.execute(
            f"SELECT {cols} FROM rank_status ORDER BY run, rank")]

    def rejected(self) -> dict[str, int]:
        """Rejections counted by earlier runs on this database, by reason."""
        return {key.removeprefix("rejected."): n for key, n in self.conn.execute(
            "SELECT key, value FROM counters WHERE key LIKE 'rejected.%'")}

    def set_snapshot(self, parts: list[bytes]) -> None:
        """The engine state(s) this commit leaves behind (one per shard; see snapshot.py)."""
        self.conn.execute("DELETE FROM snapshot")
        self.conn.executemany("INSERT INTO snapshot VALUES (?, ?)", enumerate(parts))

    def snapshot(self) -> list[bytes]:
        """The last committed engine state(s); empty for a new database."""
        return [body for (body,) in self.conn.execute("SELECT body FROM snapshot "
                                                      "ORDER BY part")]

    def commit(self) -> None:
        self._index_frames()
        self.conn.commit()

    def close(self) -> None:
        self.commit()
        self._shut(flush=True)

    def abandon(self) -> None:
        """Close without committing: the open transaction is dropped, the records file's
        writer stopped whatever it failed on (the next open cuts the file back to the
        frames committed)."""
        self._shut(flush=False)

    def _shut(self, flush: bool) -> None:
        """The connection, the records file (its writer flushed, or just stopped), then the
        write lock: after the connection (see _hold)."""
        self.conn.close()
        if self._file is not None:
            (self._writer.close if flush else self._writer.stop)()
            self._file.close()
            self._file = None
        _let_go(self._lock)
        self._lock = None

    # -- reading ---------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        """Every finding, typed (engine/findings.py); :class:`StoreError` names the first
        that does not read as one (a kind or a detail this commcheck does not know)."""
        rows = self.conn.execute(
            "SELECT id, kind, run, op, grp, seq, step, culprits, hosts, callsite, detail, "
            "ambiguous, t FROM findings ORDER BY t, id")
        out = []
        for i, k, run, op, g, seq, step, c, h, site, d, a, t in rows:
            try:
                out.append(Finding.from_json({
                    "kind": k, "run": run, "op": op, "group": g, "seq": seq, "step": step,
                    "culprits": json.loads(c), "hosts": json.loads(h), "callsite": site,
                    "detail": json.loads(d), "ambiguous": bool(a), "t": t}))
            except (ValueError, TypeError) as e:  # msgspec.ValidationError is a ValueError
                raise StoreError(f"{self.name}: finding {i} (kind {k!r}) is not one this "
                                 f"commcheck reads ({e})") from None
        return out

    def _has(self, table: str) -> bool:
        return self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                                 (table,)).fetchone() is not None

    def summary(self) -> StoreSummary:
        q = self.conn.execute
        self._index_frames()
        ranks = [RankRow(run=run, rank=r, host=h, node=n, hello=bool(he), goodbye=bool(gb),
                         records=rc, counters=json.loads(c or "{}"),
                         last=msgspec.json.decode(last, type=LastEntered) if last else None)
                 for run, r, h, n, he, gb, rc, c, last in q("SELECT * FROM ranks ORDER BY rank")]
        if self._has("endings"):  # a database of an older commcheck has none
            ends = {(run, r): Ending(how, code, sig, error or "", thread or "") for
                    run, r, how, code, sig, error, thread in q("SELECT * FROM endings")}
            for row in ranks:
                row.ending = ends.get((row.run, row.rank)) if row.goodbye else None
        kept = [t for t in ("batches", "record_frames") if self._has(t)]
        in_tables = sum(q(f"SELECT COALESCE(SUM(n), 0) FROM {t}").fetchone()[0] for t in kept)
        runs = " UNION ".join(f"SELECT run FROM {t}" for t in ("main.records", *kept))
        return StoreSummary(
            records=q("SELECT COUNT(*) FROM main.records").fetchone()[0] + in_tables,
            findings=q("SELECT COUNT(*) FROM findings").fetchone()[0],
            runs=[r for (r,) in q(f"SELECT DISTINCT run FROM ({runs}) ORDER BY run")],
            ranks=ranks,
            counters=dict(q("SELECT key, value FROM counters")),
        )

    def frames(self, run: str | None = None, rank: int | None = None) -> Iterator[bytes]:
        """The messages kept in the records file (``file`` mode), as received, in the order
        stored; only those the database committed (and, with ``run``/``rank``, only
        theirs: the index is read, not the whole file)."""
        self._index_frames()
        if not self._has("record_frames"):
            return
        where, params = _frame_filter(run, rank)
        rows = self.conn.execute(f"SELECT off, len FROM record_frames{where} ORDER BY rowid",
                                 params).fetchall()
        if not rows:
            return
        path = records_path(self.name)
        try:
            with open(path, "rb") as f:
                for off, n in rows:
                    f.seek(off)
                    body = f.read(n)
                    if len(body) != n:
                        raise StoreError(f"{path}: ends before the records {self.name} "
                                         f"committed (truncated or replaced)")
                    yield body
        except OSError as e:
            raise StoreError(f"{path}: the records file of {self.name} cannot be read "
                             f"({e.strerror})") from None

    def batches(self, run: str | None = None, rank: int | None = None) -> Iterator[Batch]:
        """Batches kept in ``batches`` and ``file`` modes, decoded, in the order stored."""
        if self._has("batches"):
            where, params = _frame_filter(run, rank)
            for (body,) in self.conn.execute(f"SELECT body FROM batches{where} ORDER BY rowid",
                                             params).fetchall():
                yield decode(body)
        for body in self.frames(run, rank):
            yield decode(body)

    def query(self, run: str | None = None, rank: int | None = None) -> sqlite3.Connection:
        """The database's connection, where ``records`` is every record kept, whatever the
        mode: a TEMP table (shadowing the stored one) filled with the stored rows and the
        decoded batches, ``run``/``rank`` only if given. Decoding costs ~10 µs a record:
        filter big runs."""
        conn = self.conn
        conn.execute("DROP TABLE IF EXISTS temp.records")
        conn.execute(f"CREATE TEMP TABLE records ({', '.join(RECORD_COLUMNS)})")
        where, params = _frame_filter(run, rank)
        conn.execute(f"INSERT INTO temp.records SELECT * FROM main.records{where}", params)
        for batch in self.batches(run, rank):
            conn.executemany("INSERT INTO temp.records VALUES "
                             f"({','.join('?' * len(RECORD_COLUMNS))})", record_rows(batch))
        return conn


def _frame_filter(run: str | None, rank: int | None) -> tuple[str, tuple]:
    conds, params = [], []
    for col, value in (("run", run), ("rank", rank)):
        if value is not None:
            conds.append(f"{col} = ?")
            params.append(value)
    return (" WHERE " + " AND ".join(conds) if conds else ""), tuple(params)
