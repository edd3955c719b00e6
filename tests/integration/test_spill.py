"""Collector absent: the rank side keeps a bounded outbox, then spills to a file (or drops),
counts it, never blocks the caller, and delivers the spilled batches, and the counts, once
the collector is there (real collector subprocess, real DEALER socket)."""

from __future__ import annotations

import time

import pytest

from commcheck.rank.spill import Spill, spill_path

from ..harness import free_port, report_json
from .test_delivery import collector, sender, stored_seqs, submit, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_absent_collector_spills_then_delivers_everything(tmp_path):
    port, db = free_port(), tmp_path / "run.db"
    path = spill_path(str(tmp_path / "spill"), "spill", 0)
    s = sender(f"tcp://127.0.0.1:{port}", "spill", buffer_bytes=100_000,
               spill=Spill(path, 64 << 20))
    worst = submit(s, 0, 3000)
    wait_for(lambda: s.counters["spilled"] > 0 and s.spill.pending, 30, "a spill")
    assert s.outbox.bytes <= 100_000 + 30_000  # bounded (give or take one batch)
    assert path.exists()
    col = collector(tmp_path, port, 1, db, "--exit-when-done")
    worst = max(worst, submit(s, 3000, 500))
    s.close(linger=30)
    out, err = col.communicate(timeout=60)
    assert col.returncode == 0, err
    assert stored_seqs(db, "spill") == list(range(3500))
    assert worst < 0.5, f"submit() took {worst:.3f} s"  # GIL hand-offs, never I/O
    assert not path.exists()  # delivered: the spill file is gone
    code, doc = report_json(db)
    assert code == 0
    assert doc["summary"]["spilled_on_ranks"] == s.counters["spilled"] > 0
    assert doc["summary"]["dropped_on_ranks"] == 0
    assert "spilled to disk" in out


def test_absent_collector_without_spill_dir_drops_and_counts(tmp_path):
    port, db = free_port(), tmp_path / "run.db"
    s = sender(f"tcp://127.0.0.1:{port}", "drop", buffer_bytes=20_000)
    t0 = time.perf_counter()
    worst = submit(s, 0, 3000)
    wait_for(lambda: s.counters["dropped"] > 0, 30, "a drop")
    assert time.perf_counter() - t0 < 30
    col = collector(tmp_path, port, 1, db, "--exit-when-done")
    s.close(linger=30)
    out, err = col.communicate(timeout=60)
    assert col.returncode == 0, err
    seqs = stored_seqs(db, "drop")
    dropped = s.counters["dropped"]
    assert len(seqs) == 3000 - dropped and len(set(seqs)) == len(seqs)
    assert worst < 0.5
    code, doc = report_json(db)
    assert doc["summary"]["dropped_on_ranks"] == dropped > 0
    assert "records dropped on ranks" in out
