"""The processes ``commcheck run`` starts beside torchrun: the job's collector and the node's
relay, each waited for through a ready file in the launcher's private temporary directory,
and stopped (delivery and every goodbye first, then SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import LaunchError, log
from .options import PY, Plan


def die_with_parent() -> None:
    """Children get SIGTERM if the launcher is killed outright (Linux), never orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def wait_then_stop(proc: subprocess.Popen, timeout: float, why: str) -> bool:
    """Let ``proc`` end on its own for ``timeout`` s; then log ``why``, SIGTERM, SIGKILL.
    Whether it ended on its own."""
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        log(why)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return False


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text().strip()
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.05)


class Forwarder:
    """Passes termination signals to torchrun, which runs in its own session so that each
    signal reaches it exactly once, and remembers that one came."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.signalled = 0
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)


def fresh_db() -> str:
    """A new database under ``runs/`` (``commcheck-<time>.db``, ``-2``, ... when taken),
    created empty and private so that two launches in the same second never share one."""
    Path("runs").mkdir(exist_ok=True)
    stem = f"runs/commcheck-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        path = f"{stem}.db" if n == 1 else f"{stem}-{n}.db"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise LaunchError(f"{path}: cannot create the database ({e.strerror})") from None
    raise LaunchError(f"{stem}.db: every name up to -999 is taken; give --db")


def run_keys(plan: Plan, tmp: Path) -> bool:
    """Whether this launch makes CURVE keys of its own, and if so where: in its private
    (0700) temporary directory, removed with it, so that only the job's user can send as
    the job's ranks (docs/security.md). Only where the collector and every rank are
    this node's: other nodes could not read them (a multi-node job brings --curve-dir)."""
    if not plan.bind or plan.opts.curve_dir or plan.nnodes > 1:
        return False
    plan.opts.curve_dir = str(tmp / "keys")
    return True


class CollectorProcess:
    """``commcheck collect`` for the job; it prints the report when it stops. Its stderr is
    passed on, its last line kept for a start that fails."""

    def __init__(self, plan: Plan, tmp: Path, new_keys: bool = False):
        o = plan.opts
        self.db = o.db or fresh_db()
        Path(self.db).parent.mkdir(parents=True, exist_ok=True)
        self.ready = tmp / "collector.ready"
        cmd = [PY, "-m", "commcheck", "collect", "--bind", plan.bind,
               "--world-size", str(plan.world), "--db", self.db,
               "--ready-file", str(self.ready), "--no-live", "--exit-when-done",
               "--hang-timeout", repr(o.hang_timeout), "--fresh"]
        if o.curve_dir:
            cmd += ["--curve-dir", o.curve_dir] + (["--new-keys"] if new_keys else [])
        if o.metrics:
            cmd += ["--metrics", o.metrics]
        if o.straggler:
            cmd += ["--straggler", o.straggler]
        self.last_line = ""
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True,
                                     preexec_fn=die_with_parent)
        self._pump = threading.Thread(target=self._pass_on, daemon=True)
        self._pump.start()

    def _pass_on(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.strip():
                self.last_line = line.strip()
            if not line.startswith("commcheck: error:"):
                sys.stderr.write(line)
                sys.stderr.flush()

    def start(self, timeout: float) -> str:
        endpoint = _wait_file(self.ready, self.proc, timeout)
        if endpoint is None:
            self.proc.kill()
            self.proc.wait()
            self._pump.join(5)
            why = self.last_line.removeprefix("commcheck: error: ") or "no reason given"
            raise LaunchError(f"the collector did not start: {why}")
        return endpoint

    def stop(self, timeout: float) -> int:
        """Let it finish (every goodbye) for ``timeout`` s, then SIGTERM, then SIGKILL; its
        exit status is the report's unless it was killed."""
        wait_then_stop(self.proc, timeout, f"not every rank said goodbye within {timeout:g} "
                                           f"s; stopping the collector")
        self._pump.join(5)
        rc = status(self.proc.returncode)
        log(f"collector pid {self.proc.pid} stopped (status {rc})")
        return rc

    def error(self) -> str:
        """The one line a collector that failed ended with (``commcheck: error:`` lines are
        kept back from the user until then), or ""."""
        line = self.last_line
        return line.removeprefix("commcheck: error: ") if line.startswith("commcheck: error:") \
            else ""

    def nobody_connected(self) -> bool:
        """No rank ever reached the collector (read from the database's report)."""
        r = subprocess.run([PY, "-m", "commcheck", "report", self.db, "--json"],
                           capture_output=True, text=True)
        try:
            return json.loads(r.stdout)["summary"]["ranks"] == 0
        except (ValueError, KeyError, TypeError):
            return False

    def report(self) -> int:
        """The report again, read from the database, when the collector printed none."""
        return subprocess.run([PY, "-m", "commcheck", "report", self.db]).returncode


class RelayProcess:
    """This node's ``commcheck relay``, started before torchrun so that the ranks find it
    holding the run's lock (they start one themselves when none does); it exits by itself
    once the node's ranks are done and delivered."""

    def __init__(self, plan: Plan, env: dict[str, str], tmp: Path):
        self.ready = tmp / "relay.ready"
        cmd = [PY, "-m", "commcheck.relay", "--run", plan.run_id, "--node", str(plan.node),
               "--expect", str(plan.nproc), "--collector", plan.collector, "--log", "auto",
               "--ready-file", str(self.ready)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, start_new_session=True)
        self.serving = False

    def wait_ready(self, timeout: float) -> bool:
        pid = _wait_file(self.ready, self.proc, timeout)
        self.serving = pid not in (None, "", "0")  # else another relay has the node's rings
        if pid is not None:
            log(f"relay pid {pid} serves this node" if pid not in ("", "0") else
                "another relay already serves this node's run")
        return pid is not None

    def stop(self, timeout: float) -> bool:
        """torchrun has exited: no more ranks will come (SIGUSR1, see the relay's
        ``_on_no_more_ranks``); let it deliver what they wrote, for ``timeout`` s. Whether
        it served the node's rings and ended on its own (it had nothing more to send)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)
        ended = wait_then_stop(self.proc, timeout, f"the relay had not delivered everything "
                                                   f"after {timeout:g} s; stopping it")
        return ended and self.serving

