"""SQLite persistence of records, findings, ranks and collector counters.

One file per collector. ``meta`` marks the file as commcheck's and carries the schema
version, so ``collect``, ``report`` and ``analyze`` refuse anything else with one clear line.
Version 2: every commit holds the engine's snapshot, and a restart continues from it; a
version-1 database may predate snapshots (its restart replayed message bodies), so it is
refused rather than half understood.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from ..engine import Finding, RankState
from ..engine.findings import LastEntered
from ..engine.model import group_label
from ..wire import Batch, decode, encode

SCHEMA_VERSION = 2
MAGIC = "commcheck"

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
"""

STATUS_COLUMNS = ("run", "rank", "pid", "host", "node", "state", "proc", "goodbye", "idle",
                  "exit_code", "signal", "records", "dropped", "relay_pid", "t")


class StoreError(Exception):
    pass


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


class StoreSummary(msgspec.Struct, kw_only=True):
    """What a database holds besides its findings: the report's summary is built from it."""

    records: int  # records kept (rows and batches)
    findings: int
    runs: list[str]  # run ids of the records kept, sorted
    ranks: list[RankRow]  # by rank
    counters: dict[str, int]  # the collector's (verified, unmatched, rejected.<reason>, ...)


def _last_entered(state: RankState) -> str | None:
    """What a rank that has not said goodbye last entered, as JSON (the report shows it for
    a run that did not finish)."""
    last = state.last
    if last is None:
        return None
    meta = last.meta
    t = meta.t_enter if math.isfinite(meta.t_enter) else 0.0
    return msgspec.json.encode(LastEntered(op=meta.op, at=last.at, callsite=meta.callsite,
                                           t=t)).decode()


def _detail_text(f: Finding) -> str:
    return json.dumps(msgspec.to_builtins(f.detail))


def check_schema(path: str | Path, meta: dict[str, str]) -> None:
    """Refuse, with one line, a commcheck database of another schema version (``meta``: its
    meta table)."""
    found = meta.get("schema")
    if found == str(SCHEMA_VERSION):
        return
    if found is not None and found.isdigit() and int(found) < SCHEMA_VERSION:
        raise StoreError(f"{path}: written by an older commcheck (schema {found}; this one "
                         f"reads {SCHEMA_VERSION}): open it with the commcheck that wrote "
                         f"it, or collect into a new --db")
    raise StoreError(f"{path}: written by a newer commcheck (schema {found}; this one reads "
                     f"{SCHEMA_VERSION})")


# How records are kept (findings, ranks and counters always are): one row per record
# (queryable with SQL; the slowest), one row per batch holding the encoded envelope
# (lossless, read back with Store.batches()), or not at all.
RECORD_MODES = ("rows", "batches", "none")


def _hexes(h0, h1) -> list[str]:
    return [f"{b:016x}{a:016x}" for a, b in zip(h0.tolist(), h1.tolist(), strict=True)]


class Store:
    def __init__(self, conn: sqlite3.Connection, records: str = "rows", name: str = "database"):
        if records not in RECORD_MODES:
            raise StoreError(f"records mode {records!r}: expected one of "
                             f"{', '.join(RECORD_MODES)}")
        self.conn = conn
        self.records = records
        self.name = name  # the path, for error messages

    @classmethod
    def create(cls, path: str | Path, records: str = "rows") -> Store:
        p = Path(path)
        try:
            if p.parent and not p.parent.exists():
                p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{path}: cannot create its directory ({e.strerror})") from None
        try:
            conn = sqlite3.connect(p, check_same_thread=False)
            tables = {n for (n,) in conn.execute("SELECT name FROM sqlite_master")}
            if tables and "meta" not in tables:  # someone else's database: leave it alone
                conn.close()
                raise StoreError(f"{path}: not a commcheck database")
            existing = dict(conn.execute("SELECT key, value FROM meta")) if tables else {}
            if existing:  # checked before anything is written to it
                try:
                    if existing.get("magic") != MAGIC:
                        raise StoreError(f"{path}: not a commcheck database")
                    check_schema(path, existing)
                except StoreError:
                    conn.close()
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
            raise StoreError(f"{path}: not a usable SQLite database ({e})") from None
        conn.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)",
                         [("magic", MAGIC), ("schema", str(SCHEMA_VERSION)),
                          ("created", str(time.time()))])
        conn.commit()
        return cls(conn, records, str(path))

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
        check_schema(path, meta)
        return cls(conn, name=str(path))

    def add_batch(self, batch: Batch, raw: bytes | None = None) -> None:
        """Keep a batch's records; ``raw``, the message it was decoded from, saves
        re-encoding it in ``batches`` mode."""
        rec = batch.records
        if not len(rec) or self.records == "none":
            return
        if self.records == "batches":
            env = batch.env
            self.conn.execute("INSERT INTO batches VALUES (?,?,?,?,?)",
                              (env.run, env.rank, env.seq, len(rec),
                               raw if raw is not None else encode(env)))
            return
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
        self.conn.executemany(f"INSERT INTO records VALUES ({','.join('?' * len(cols))})",
                              zip(*cols, strict=True))

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
              json.dumps(s.counters), None if s.goodbye else _last_entered(s))
             for r, s in ranks.items()])

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
        self.conn.commit()

    def close(self) -> None:
        self.conn.commit()
        self.conn.close()

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

    def summary(self) -> StoreSummary:
        q = self.conn.execute
        ranks = [RankRow(run=run, rank=r, host=h, node=n, hello=bool(he), goodbye=bool(gb),
                         records=rc, counters=json.loads(c or "{}"),
                         last=msgspec.json.decode(last, type=LastEntered) if last else None)
                 for run, r, h, n, he, gb, rc, c, last in q("SELECT * FROM ranks ORDER BY rank")]
        has_batches = q("SELECT 1 FROM sqlite_master WHERE name = 'batches'").fetchone()
        in_batches = q("SELECT COALESCE(SUM(n), 0) FROM batches").fetchone()[0] \
            if has_batches else 0
        runs = "SELECT run FROM records" + (" UNION SELECT run FROM batches" if has_batches
                                            else "")
        return StoreSummary(
            records=q("SELECT COUNT(*) FROM records").fetchone()[0] + in_batches,
            findings=q("SELECT COUNT(*) FROM findings").fetchone()[0],
            runs=[r for (r,) in q(f"SELECT DISTINCT run FROM ({runs}) ORDER BY run")],
            ranks=ranks,
            counters=dict(q("SELECT key, value FROM counters")),
        )

    def batches(self) -> Iterator[Batch]:
        """Batches kept in ``batches`` mode, decoded, in the order they were stored."""
        if self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'batches'").fetchone():
            for (body,) in self.conn.execute("SELECT body FROM batches ORDER BY rowid"):
                yield decode(body)
