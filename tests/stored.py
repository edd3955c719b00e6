"""Tests read a database's records through the store, whatever its ``--records`` mode
(the default keeps them in a records file beside the database, not as SQL rows)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from commcheck.collector.store import Store


@contextmanager
def stored(db: str | Path) -> Iterator[sqlite3.Connection]:
    """The database's connection (read-only) where ``records`` holds every record kept."""
    store = Store.open(db)
    try:
        yield store.query()
    finally:
        store.close()
