"""Per-record cost of keeping the collector's decoded batches, the store path alone.

    PYTHONPATH=. python launch/bench/bench_store.py [RECORDS]

The bench's traffic (1024 ranks) is built and decoded first; then each candidate keeps it
in bursts of 64 batches, committing every 512 batches (~0.25 s at 1 M records/s): the
records file (collect's default), SQLite blobs (as ``--records batches``, also without a
journal, also zlib-compressed), and, when installed, Parquet (pyarrow) and DuckDB. Prints
µs per record of wall and CPU time and bytes per record on disk. docs/decisions.md
("Records at a million a second") has the figures.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import tempfile
import time
import zlib

import numpy as np

from commcheck.collector.bench import Plan, build
from commcheck.wire import RECORDS, decode

BURST, COMMIT_EVERY = 64, 512


def main() -> None:
    plan = Plan(ranks=1024, records=int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000,
                t0=time.time())
    items = [(m, b) for m in build(plan, list(range(plan.ranks)))
             if (b := decode(m)).env.kind == RECORDS]
    n = sum(len(b.records) for _, b in items)
    print(f"{len(items)} batches, {n} records, "
          f"{sum(len(m) for m, _ in items) / n:.0f} B/record as received")

    def timed(name, fn):
        tmp = tempfile.mkdtemp(prefix="commcheck-bench-store-")
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            fn(tmp)
            w, c = time.perf_counter() - t0, time.process_time() - c0
            size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        finally:
            shutil.rmtree(tmp)
        print(f"{name:44s} {w / n * 1e6:6.3f} us/rec wall {c / n * 1e6:6.3f} us/rec CPU "
              f"{size / n:6.1f} B/rec", flush=True)

    def records_file(tmp):
        with open(os.path.join(tmp, "x.records"), "ab") as f:
            for i, (m, _) in enumerate(items):
                f.write(len(m).to_bytes(4, "little"))
                f.write(m)
                if i % COMMIT_EVERY == 0:
                    f.flush()

    def sqlite_blob(body, pragmas=()):
        def run(tmp):
            conn = sqlite3.connect(os.path.join(tmp, "x.db"))
            for p in ("page_size=65536", "journal_mode=WAL", "synchronous=NORMAL", *pragmas):
                conn.execute(f"PRAGMA {p}")
            conn.execute("CREATE TABLE b (run TEXT, rank INTEGER, seq INTEGER, n INTEGER, "
                         "body BLOB)")
            for i in range(0, len(items), BURST):
                conn.executemany("INSERT INTO b VALUES (?,?,?,?,?)", [
                    (b.env.run, b.env.rank, b.env.seq, len(b.records), body(m))
                    for m, b in items[i:i + BURST]])
                if i % COMMIT_EVERY == 0:
                    conn.commit()
            conn.commit()
            conn.close()
        return run

    timed("records file (collect's default)", records_file)
    timed("SQLite blob per batch (--records batches)", sqlite_blob(lambda m: m))
    timed("SQLite blob, journal_mode=OFF", sqlite_blob(lambda m: m, ("journal_mode=OFF",
                                                                     "synchronous=OFF")))
    timed("SQLite blob, zlib level 1", sqlite_blob(lambda m: zlib.compress(m, 1)))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        print("pyarrow not installed: no Parquet, no DuckDB")
        return

    def table(burst):
        cols: dict[str, list] = {}
        for _, b in burst:
            r = b.records
            cols.setdefault("run", []).append(pa.array([b.env.run] * len(r)))
            cols.setdefault("rank", []).append(np.full(len(r), b.env.rank, np.int32))
            for f in r.dtype.names:
                if r[f].dtype.kind in "iufb" and r[f].ndim == 1:
                    cols.setdefault(f, []).append(np.ascontiguousarray(r[f]))
        return pa.table({k: pa.concat_arrays(v) if k == "run" else np.concatenate(v)
                         for k, v in cols.items()})

    def parquet(tmp):
        writer = None
        for i in range(0, len(items), BURST):
            t = table(items[i:i + BURST])
            writer = writer or pq.ParquetWriter(os.path.join(tmp, "x.parquet"), t.schema,
                                                compression="snappy")
            writer.write_table(t)
        writer.close()

    timed("Parquet (pyarrow, snappy, numeric columns)", parquet)
    try:
        import duckdb
    except ImportError:
        print("duckdb not installed")
        return

    def duck(tmp):
        con = duckdb.connect(os.path.join(tmp, "x.duckdb"))
        for i in range(0, len(items), BURST):
            t = table(items[i:i + BURST])  # noqa: F841 (read by name by DuckDB)
            con.execute("CREATE TABLE r AS SELECT * FROM t" if i == 0 else
                        "INSERT INTO r SELECT * FROM t")
        con.close()

    timed("DuckDB (Arrow insert per burst)", duck)


if __name__ == "__main__":
    main()
