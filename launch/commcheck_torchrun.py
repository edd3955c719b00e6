#!/usr/bin/env python3
"""Per-node torchrun wrapper: node rank 0 hosts the commcheck collector, every node trains.

Run it once per node (by hand, pdsh, or srun; see launch/commcheck.sbatch):

    commcheck_torchrun.py --nnodes 2 --node-rank $NODE --nproc-per-node 8 \\
        --master-addr head --curve-dir ~/.commcheck/keys -- train.py --lr 3e-4

On node rank 0 it starts ``commcheck collect`` for nnodes x nproc-per-node ranks, waits
until it listens, runs torchrun, then lets the collector finish (every rank said goodbye)
for at most --stop-timeout seconds before stopping it with SIGTERM, and prints the report
once. Other nodes only run torchrun with COMMCHECK_COLLECTOR pointing at node 0. A failed
or killed training process never skips the collector's shutdown or the report.

Every node also starts its relay before torchrun (``commcheck relay``: it ships the
records the node's ranks write into their ring files; --no-relay leaves that to the first
rank of the node) and gives it --stop-timeout seconds after torchrun to deliver.

Exit status: torchrun's when it failed (128 + N when it died of signal N), else the
report's (0 clean, 1 findings, 2 no usable database). SIGTERM/SIGINT/SIGHUP are passed to
torchrun, and then the collector gets at most a few seconds to finish.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
SIGNALLED_STOP_TIMEOUT = 5.0


def die_with_parent() -> None:
    """Children get SIGTERM if this wrapper is killed outright (Linux), never orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def log(msg: str) -> None:
    print(f"commcheck-torchrun: {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        log("error: put torchrun's script and arguments after '--', e.g. -- train.py")
        raise SystemExit(2)
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="commcheck_torchrun.py", description=__doc__.split("\n")[0])
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--master-addr", required=True, help="node 0's address (also the "
                                                        "collector's unless --collector-host)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--collector-port", type=int, default=5555)
    p.add_argument("--collector-host", default="", help="address ranks use to reach the "
                                                        "collector (default: --master-addr)")
    p.add_argument("--collector-bind", default="", help="address node 0 binds (default: "
                                                        "0.0.0.0, or 127.0.0.1 for one node)")
    p.add_argument("--db", default="", help="collector database (default: "
                                            "runs/commcheck-<time>.db)")
    p.add_argument("--curve-dir", default=os.environ.get("COMMCHECK_CURVE_DIR", ""),
                   help="CURVE keys from `commcheck keygen` (default: $COMMCHECK_CURVE_DIR)")
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds to wait for every rank's goodbye after torchrun exits")
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                   help="start this node's relay before torchrun (default; without it the "
                        "first rank on the node starts one)")
    p.add_argument("--torchrun", default="", help="torchrun executable (default: the one "
                                                  "next to this Python, else on PATH)")
    args = p.parse_args(argv[:cut])
    if not argv[cut + 1:]:
        p.error("nothing to run after '--'")
    if not 0 <= args.node_rank < args.nnodes or args.nproc_per_node < 1:
        p.error("need 0 <= --node-rank < --nnodes and --nproc-per-node >= 1")
    return args, argv[cut + 1:]


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


def wait_then_stop(proc: subprocess.Popen, timeout: float, why: str) -> None:
    """Let ``proc`` end on its own for ``timeout`` s; then log ``why``, SIGTERM, SIGKILL."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log(why)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def torchrun_cmd(args: argparse.Namespace, rest: list[str]) -> list[str]:
    exe = args.torchrun or str(Path(PY).parent / "torchrun")
    if not args.torchrun and not Path(exe).exists():
        exe = "torchrun"
    return [exe, f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
            f"--nproc-per-node={args.nproc_per_node}", f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}", *rest]


def run_training(cmd: list[str], env: dict[str, str], fwd: Forwarder) -> int:
    if fwd.signalled:
        log(f"signal {fwd.signalled} came before training started; not starting it")
        return 128 + fwd.signalled
    log(f"starting {' '.join(cmd)}")
    try:
        fwd.child = subprocess.Popen(cmd, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)
    except OSError as e:
        log(f"cannot start torchrun: {e}")
        return 127
    rc = status(fwd.child.wait())
    log(f"torchrun exited with status {rc}")
    return rc


class CollectorProcess:
    """``commcheck collect`` in the background; its report is printed by :meth:`report`."""

    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.db = args.db or f"runs/commcheck-{time.strftime('%Y%m%d-%H%M%S')}.db"
        Path(self.db).parent.mkdir(parents=True, exist_ok=True)
        bind_host = args.collector_bind or ("127.0.0.1" if args.nnodes == 1 else "0.0.0.0")
        self.ready = tmp / "collector.ready"
        cmd = [PY, "-m", "commcheck.cli", "collect",
               "--bind", f"tcp://{bind_host}:{args.collector_port}",
               "--world-size", str(args.nnodes * args.nproc_per_node), "--db", self.db,
               "--ready-file", str(self.ready), "--no-live", "--exit-when-done"]
        if args.curve_dir:
            cmd += ["--curve-dir", args.curve_dir]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent)

    def wait_listening(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        log(f"collector pid {self.proc.pid} listening on {self.ready.read_text().strip()}, "
            f"db {self.db}")
        return True

    def stop(self, timeout: float) -> None:
        """Let it finish on its own for ``timeout`` s, then SIGTERM, then SIGKILL."""
        wait_then_stop(self.proc, timeout, f"not every rank said goodbye within {timeout:g} "
                                           f"s; stopping the collector")
        log(f"collector pid {self.proc.pid} stopped (status {status(self.proc.returncode)})")

    def report(self) -> int:
        return subprocess.run([PY, "-m", "commcheck.cli", "report", self.db]).returncode


class RelayProcess:
    """This node's ``commcheck relay``, started before torchrun so that the ranks find it
    (it holds the run's lock); it exits by itself once the node's ranks are done and
    delivered. Its log goes next to the rings (kept only when something went wrong)."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], tmp: Path):
        self.ready = tmp / "relay.ready"
        cmd = [PY, "-m", "commcheck.relay", "--run", env["COMMCHECK_RUN_ID"],
               "--node", str(args.node_rank), "--expect", str(args.nproc_per_node),
               "--collector", env["COMMCHECK_COLLECTOR"], "--log", "auto",
               "--ready-file", str(self.ready)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        pid = int(self.ready.read_text().strip() or 0)
        log(f"relay pid {pid} serves this node" if pid else
            "another relay already serves this node's run")
        return True

    def stop(self, timeout: float) -> None:
        """Let it deliver and exit for ``timeout`` s, then SIGTERM (it delivers for its
        linger more and leaves the rest in the ring files)."""
        wait_then_stop(self.proc, timeout, f"the relay had not delivered everything after "
                                           f"{timeout:g} s; stopping it")


def main(argv: list[str]) -> int:
    args, rest = parse(argv)
    fwd = Forwarder()
    env = dict(os.environ)
    env["COMMCHECK_COLLECTOR"] = \
        f"tcp://{args.collector_host or args.master_addr}:{args.collector_port}"
    if args.curve_dir:
        env["COMMCHECK_CURVE_DIR"] = args.curve_dir
    # the ranks and this node's relay must agree on the run (torchrun's default run id)
    env.setdefault("COMMCHECK_RUN_ID", f"{args.master_addr}:{args.master_port}")
    cmd = torchrun_cmd(args, rest)
    with tempfile.TemporaryDirectory(prefix="commcheck-torchrun-") as tmp:
        collector = None
        if args.node_rank == 0:
            collector = CollectorProcess(args, Path(tmp))
            if not collector.wait_listening(args.start_timeout):
                collector.stop(0)
                log("the collector did not start; training runs unchecked")
                del env["COMMCHECK_COLLECTOR"]
                return run_training(cmd, env, fwd)
        relay = RelayProcess(args, env, Path(tmp)) if args.relay else None
        if relay is not None and not relay.wait_ready(args.start_timeout):
            log("the relay did not start; the first rank on this node starts one")
        rc = run_training(cmd, env, fwd)
        timeout = min(args.stop_timeout, SIGNALLED_STOP_TIMEOUT) if fwd.signalled \
            else args.stop_timeout
        t0 = time.monotonic()
        if relay is not None:
            relay.stop(timeout)
        if collector is None:
            return rc
        collector.stop(max(0.0, timeout - (time.monotonic() - t0)))
    report_rc = collector.report()
    return rc or report_rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
