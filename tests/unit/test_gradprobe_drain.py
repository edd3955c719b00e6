"""The writer's exit path: drained by the signal handler it chains before the previous
one, never installed from another thread, and a marker that outlives only a killed run."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
import torch

from commcheck.gradprobe import GradProbe, drain
from commcheck.gradprobe.writer import MARKER, DumpWriter

pytestmark = pytest.mark.timeout(30)


def probe_with_queued_steps(tmp_path, steps: int = 3) -> GradProbe:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = GradProbe(model, level="L1", dump_path=str(tmp_path), optimizer=opt)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    return probe


def test_signal_handler_drains_then_runs_the_previous_handler(tmp_path, monkeypatch):
    probe = probe_with_queued_steps(tmp_path)
    seen = []
    monkeypatch.setitem(drain._previous, signal.SIGTERM,
                        lambda signum, frame: seen.append(sorted(os.listdir(tmp_path / "rank0"))))
    drain._on_signal(signal.SIGTERM, None)
    assert seen and {f"grad_summary_{s}.csv" for s in range(3)} <= set(seen[0])
    assert probe.writer_counters.steps_written == 3
    probe.stop()
    assert not (tmp_path / "rank0" / MARKER).exists()


def test_handlers_are_installed_only_from_the_main_thread(monkeypatch):
    monkeypatch.setattr(drain, "_previous", {})
    out = []
    t = threading.Thread(target=lambda: out.append(drain.install_handlers()))
    t.start()
    t.join()
    assert out == [False] and drain._previous == {}


def test_exit_drain_writes_every_queued_step_and_removes_the_marker(tmp_path):
    probe = probe_with_queued_steps(tmp_path, steps=4)
    assert (tmp_path / "rank0" / MARKER).exists()
    drain.drain_all()
    assert {f"grad_summary_{s}.csv" for s in range(4)} <= set(os.listdir(tmp_path / "rank0"))
    assert not (tmp_path / "rank0" / MARKER).exists()
    probe.stop()  # idempotent after the exit drain


def test_a_marker_left_by_a_dead_writer_is_reported(tmp_path, caplog):
    dead = 4194305  # above the largest pid Linux hands out
    (tmp_path / MARKER).write_text(f"pid={dead} host={socket.gethostname()} started=x\n")
    w = DumpWriter(False, str(tmp_path))
    try:
        assert w.counters.unclean_previous is not None and f"pid={dead}" in \
            w.counters.unclean_previous
        assert "ended without draining" in caplog.text
        assert f"pid={os.getpid()}" in (tmp_path / MARKER).read_text()
    finally:
        assert w.stop()
    assert not (tmp_path / MARKER).exists()


def test_a_marker_of_a_live_writer_is_not_reported(tmp_path):
    (tmp_path / MARKER).write_text(f"pid={os.getpid()} host={socket.gethostname()} started=x\n")
    w = DumpWriter(False, str(tmp_path))
    assert w.counters.unclean_previous is None
    w.stop()
