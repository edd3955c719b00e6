"""The gradient probe's writer drains when the script ends without ``stop()``: at normal
exit and on SIGTERM/SIGINT every step that finished is on disk; after SIGKILL the next run
says what may be missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from commcheck.gradprobe.writer import MARKER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WORKER = Path(__file__).parent.parent / "workers" / "gradprobe_exit.py"
ROOT = Path(__file__).parent.parent.parent
STEPS = 6
PARAMS = ("0.weight", "0.bias", "1.weight", "1.bias")


def _sigint_default() -> None:
    """SIGINT as a terminal leaves it: a test run started in the background by a shell
    without job control inherits it ignored, and Python then raises no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(dump: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "DUMP": str(dump),
                        "STEPS": str(STEPS), **env}, preexec_fn=_sigint_default)


def assert_every_step_written(dump: Path) -> None:
    rank = dump / "rank0"
    for step in range(STEPS):
        assert (rank / f"grad_summary_{step}.csv").stat().st_size > 0, step
        for name in PARAMS:
            assert (rank / f"step{step}" / f"{name}.npy").exists(), (step, name)
    assert not (rank / MARKER).exists()


def signalled(dump: Path, sig: int) -> subprocess.CompletedProcess:
    proc = start(dump, WAIT="1")
    assert proc.stdout.readline().strip() == f"stepped {STEPS}"  # steps still queued
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_script_without_stop_leaves_every_step(tmp_path):
    proc = start(tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert_every_step_written(tmp_path)


def test_sigterm_mid_run_leaves_every_finished_step_and_still_ends_by_sigterm(tmp_path):
    done = signalled(tmp_path, signal.SIGTERM)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert_every_step_written(tmp_path)


def test_sigint_drains_then_raises_keyboard_interrupt(tmp_path):
    done = signalled(tmp_path, signal.SIGINT)
    assert done.returncode == -signal.SIGINT and "KeyboardInterrupt" in done.stderr, \
        done.stderr
    assert_every_step_written(tmp_path)


def test_after_sigkill_the_next_run_says_steps_may_be_missing(tmp_path):
    proc = start(tmp_path, WAIT="1", DELAY_S="2")
    assert proc.stdout.readline().strip() == f"stepped {STEPS}"
    proc.kill()
    proc.communicate(timeout=30)
    assert (tmp_path / "rank0" / MARKER).exists()
    again = start(tmp_path, DELAY_S="0")
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert "ended without draining" in err and f"pid={proc.pid}" in err
    assert_every_step_written(tmp_path)
