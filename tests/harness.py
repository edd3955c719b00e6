"""Launching real parts for integration tests: a collector subprocess on a loopback port
and torchrun node groups that simulate several nodes on this machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKERS = ROOT / "tests" / "workers"


_started: list[subprocess.Popen] = []


def reap() -> None:
    """Kill what a test started and left running (a failed assertion skips its cleanup)."""
    while _started:
        p = _started.pop()
        with contextlib.suppress(OSError):  # a job's node group (start_job): workers too
            os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_world(tmp_path: Path, monkeypatch, run: str, patch_first: bool = False):
    """A gloo world of one rank in this process, its records dumped to ``tmp_path`` under
    run id ``run`` (``patch_first``: patch() before the group exists); a generator for a
    fixture: unpatches and destroys the group after the test."""
    import torch.distributed as dist

    import commcheck

    monkeypatch.setenv("COMMCHECK_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("COMMCHECK_RUN_ID", run)
    monkeypatch.delenv("COMMCHECK_COLLECTOR", raising=False)
    monkeypatch.delenv("COMMCHECK_INJECT", raising=False)
    if patch_first:
        assert commcheck.patch()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    commcheck.unpatch()
    if dist.is_initialized():
        dist.destroy_process_group()


def commcheck_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "commcheck.cli", *args]


@dataclass
class Collector:
    proc: subprocess.Popen
    endpoint: str
    db: Path

    def wait(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def terminate(self) -> tuple[int, str, str]:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(30)


def start_collector(tmp: Path, world: int, *extra: str, port: int | None = None,
                    db: Path | None = None) -> Collector:
    """A collector subprocess; a fixed ``port`` and ``db`` let a restart take the same ones."""
    db = db or tmp / "run.db"
    ready = tmp / f"collector.ready.{time.monotonic_ns()}"
    bind = f"tcp://127.0.0.1:{port if port is not None else '*'}"
    proc = subprocess.Popen(
        commcheck_cmd("collect", "--bind", bind, "--world-size", str(world),
                      "--db", str(db), "--ready-file", str(ready), "--no-live", *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)
    _started.append(proc)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"collector did not start: {proc.communicate()}")
        time.sleep(0.05)
    return Collector(proc, ready.read_text().strip(), db)


def start_job(script: Path, env: dict[str, str], nnodes: int = 2, nproc: int = 2,
              args: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """Start ``script`` as ``nnodes`` torchrun node groups of ``nproc`` ranks on loopback,
    each in a session of its own (``os.killpg`` ends a node group with its workers).

    Each node group gets its own host label (node0, node1, ...), as separate machines would.
    """
    port = free_port()
    procs = []
    for node in range(nnodes):
        node_env = {**os.environ, **env, "COMMCHECK_HOST": f"node{node}",
                    "PYTHONUNBUFFERED": "1"}
        cmd = [str(BIN / "torchrun"), f"--nnodes={nnodes}", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={port}", str(script), *args]
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
        _started.append(procs[-1])
    return procs


def run_job(script: Path, env: dict[str, str], nnodes: int = 2, nproc: int = 2,
            timeout: float = 240, args: tuple[str, ...] = ()) -> list[subprocess.CompletedProcess]:
    """Run ``script`` as torchrun node groups (:func:`start_job`) to the end."""
    results = []
    for p in start_job(script, env, nnodes, nproc, args):
        out, _ = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return results


def report_json(db: Path) -> tuple[int, dict]:
    """``commcheck report DB --json``: (exit status, document), through the CLI's own
    ``main`` in this process, as the unit tests call it: a new interpreter per read cost
    ~0.7 s of CPU, ~45 times a suite. The installed command is run by test_cli_entry_point
    and by every test that reads the text report."""
    from commcheck.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["report", str(db), "--json"])
    return code, json.loads(out.getvalue())


def call_lines(script: Path) -> dict[str, int]:
    """``# CALL:name`` markers of a worker script, by name → line number."""
    lines = {}
    for n, line in enumerate(script.read_text().splitlines(), start=1):
        m = re.search(r"# CALL:(\w+)", line)
        if m:
            lines[m.group(1)] = n
    return lines
