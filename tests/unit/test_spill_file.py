"""A rank's spill file (kept by the relay) and its configured bounds."""

from __future__ import annotations

from commcheck.rank.config import load_config
from commcheck.relay.spill import Spill, spill_path


def test_spill_config_defaults_are_a_few_mib():
    cfg = load_config(env={"COMMCHECK_SPILL_DIR": "/tmp/x", "COMMCHECK_BUFFER_BYTES": "1000"})
    assert cfg.spill_dir == "/tmp/x" and cfg.buffer_bytes == 1000
    assert 1 << 20 <= load_config(env={}).buffer_bytes <= 16 << 20

def test_spill_file_is_fifo_and_bounded(tmp_path):
    s = Spill(spill_path(str(tmp_path), "run/x", 3), max_bytes=100)
    assert s.put(0, 1, b"a" * 30, 2) and s.put(1, 1, b"b" * 30, 3)
    assert not s.put(2, 1, b"c" * 60, 1)  # beyond max_bytes: the caller drops
    assert s.pending == 2 and s.records == 5 and s.peek() == 30
    assert s.take() == (0, 1, b"a" * 30, 2)
    assert s.take() == (1, 1, b"b" * 30, 3)
    assert s.pending == 0 and not s.put(2, 1, b"c" * 60, 1)  # taken back, not yet acked
    s.acked([(1, 0), (1, 1)])  # kept until acknowledged: a relay may die meanwhile
    assert s.held == 0 and s.put(2, 1, b"c" * 60, 1)  # the file started over
    assert s.path.read_bytes().startswith(b"COMMCHECK-WIRE\n")
    s.discard()
    assert not s.path.exists()
