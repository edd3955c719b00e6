"""``commcheck run``: torchrun with commcheck in every rank, the script untouched.

Run once per node, with torchrun's options. On a single node or node rank 0 it starts
``commcheck collect`` for the whole job (unless ``--collector`` names one), waits until it
listens, starts this node's relay, runs torchrun with a bootstrap ``sitecustomize`` first on
the ranks' ``PYTHONPATH`` (see :mod:`commcheck.rank.boot`), then lets the relay deliver and
the collector see every goodbye (at most ``--stop-timeout`` s each) and prints the report
once. Other nodes run torchrun the same way, their ranks pointed at node 0's collector.

Exit status: torchrun's when training failed (128 + N for signal N), else the report's (0
clean, 1 findings, 3 unfinished); 2 for bad input, with one line on stderr. SIGTERM, SIGINT
and SIGHUP go to torchrun; the collector then gets a few seconds to finish.

This module only starts processes (the collector, the relay, torchrun) and imports neither
side of commcheck: the launcher is a process manager, nothing more. The one exception is
native code made ready before training (:mod:`commcheck.native.prebuild`): the C++ DDP hook
is built here, before torchrun, so no rank waits on a compiler (docs/native.md).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

PY = sys.executable
SIGNALLED_STOP_TIMEOUT = 5.0
DEFAULT_COLLECTOR_PORT = 5555
BOOT_MARK = "COMMCHECK_BOOT"  # commcheck.rank.boot.MARK
SITECUSTOMIZE = """\
import sys
try:
    from commcheck.rank.boot import boot
except ImportError:
    sys.path.append({pkg_parent!r})
    from commcheck.rank.boot import boot
boot({here!r})
"""


class LaunchError(Exception):
    """Bad input or a launcher that cannot start: one line on stderr, exit status 2."""


def log(msg: str) -> None:
    print(f"commcheck run: {msg}", file=sys.stderr, flush=True)


def _own_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("commcheck (before SCRIPT; everything else goes to torchrun)")
    g.add_argument("--db", default="", help="collector database (default: "
                                            "runs/commcheck-<time>.db)")
    g.add_argument("--hang-timeout", type=float, default=30.0,
                   help="seconds a collective may wait for missing members (collect's)")
    g.add_argument("--curve-dir", default=os.environ.get("COMMCHECK_CURVE_DIR", ""),
                   help="CURVE keys from `commcheck keygen` (default: $COMMCHECK_CURVE_DIR)")
    g.add_argument("--collector", default="",
                   help="ZeroMQ endpoint of a running `commcheck collect`: start none, send "
                        "there (default on node rank > 0: node 0's, tcp://MASTER_ADDR:PORT)")
    g.add_argument("--collector-port", type=int, default=0,
                   help=f"port node 0's collector binds (default: {DEFAULT_COLLECTOR_PORT} "
                        f"with several nodes, a free loopback port with one)")
    g.add_argument("--metrics", default="", help="collect's --metrics: serve Prometheus "
                                                 "metrics on HOST:PORT (bare PORT: loopback)")
    g.add_argument("--straggler", default="",
                   help="collect's --straggler: when a rank is a straggler (key=value,... or "
                        "off)")
    g.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds to wait for delivery and every goodbye after torchrun exits")
    g.add_argument("--start-timeout", type=float, default=60.0,
                   help="seconds to wait for the collector and relay to start")
    g.add_argument("--torchrun", default="", help="torchrun executable (default: "
                                                  "python -m torch.distributed.run)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise LaunchError(message)


def _torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (this torch's options, exactly), plus commcheck's."""
    try:
        from torch.distributed.run import get_args_parser
    except ImportError as e:
        raise LaunchError(f"torchrun is missing: cannot import torch.distributed.run ({e})") \
            from None
    p = get_args_parser()
    p.prog = "commcheck run"
    p.description = __doc__.split("\n\n")[0]
    p.error = _Parser.error.__get__(p)  # type: ignore[method-assign]
    _own_options(p)
    return p


@dataclass
class Plan:
    """What to start on this node."""

    torchrun: list[str]  # the command, script and arguments included
    nnodes: int
    node_rank: int
    nproc: int
    world: int
    collector: str  # endpoint the ranks send to
    bind: str  # what node 0's own collector binds; "" when it starts none
    node: int  # the ranks' GROUP_RANK when known in advance, else -1 (no relay of ours)
    run_id: str
    opts: argparse.Namespace
    env: dict[str, str] = field(default_factory=dict)


def _nnodes(value: str) -> int:
    lo, _, hi = value.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes {value}: expected N or N:N") from None
    if a != b or a < 1:
        raise LaunchError(f"--nnodes {value}: an elastic node range is not supported; "
                          f"give a fixed number of nodes")
    return a


def _started_here(tokens: list[str], *names: str) -> bool:
    return any(t.replace("_", "-").startswith(n) for t in tokens for n in names)


def parse(argv: list[str], env: dict[str, str]) -> Plan:
    ns = _torchrun_parser().parse_args(argv)
    tail = 1 + len(ns.training_script_args)
    prefix = argv[:len(argv) - tail]
    if prefix and prefix[-1] == "--":
        prefix = prefix[:-1]
    own = _Parser(allow_abbrev=False, add_help=False)
    _own_options(own)
    opts, torchrun_opts = own.parse_known_args(prefix)
    script = ns.training_script
    if not (ns.module or ns.no_python) and not os.path.isfile(script):
        raise LaunchError(f"{script}: no such script")
    nnodes = _nnodes(ns.nnodes)
    from torch.distributed.run import determine_local_world_size

    try:
        nproc = determine_local_world_size(ns.nproc_per_node)
    except ValueError as e:
        raise LaunchError(f"--nproc-per-node {ns.nproc_per_node}: {e}") from None
    if not 0 <= ns.node_rank < nnodes:
        raise LaunchError(f"--node-rank {ns.node_rank}: need 0 <= node rank < --nnodes")
    if opts.torchrun:
        exe = shutil.which(opts.torchrun)
        if exe is None:
            raise LaunchError(f"--torchrun {opts.torchrun}: torchrun is missing (no such "
                              f"executable)")
        cmd = [exe]
    else:
        cmd = [PY, "-m", "torch.distributed.run"]
    static = ns.rdzv_backend == "static" and not ns.standalone
    if nnodes == 1 and not _started_here(torchrun_opts, "--master-port", "--rdzv-",
                                         "--standalone"):
        torchrun_opts = ["--standalone", *torchrun_opts]  # no clash on port 29500
        static = False
    node = ns.node_rank if static else (0 if nnodes == 1 else -1)
    host = ns.master_addr if static or not ns.rdzv_endpoint else \
        ns.rdzv_endpoint.rsplit(":", 1)[0]
    port = opts.collector_port or DEFAULT_COLLECTOR_PORT
    bind = ""
    if opts.collector:
        collector = opts.collector
    elif ns.node_rank == 0:
        bind = f"tcp://127.0.0.1:{opts.collector_port or '*'}" if nnodes == 1 \
            else f"tcp://0.0.0.0:{port}"
        collector = ""  # known once it listens
    else:
        collector = f"tcp://{host}:{port}"
    run_id = env.get("COMMCHECK_RUN_ID", "")
    if not run_id:
        run_id = ns.rdzv_id if ns.rdzv_id not in ("", "none") else \
            f"{host}:{ns.master_port or 29500}" if nnodes > 1 else \
            f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return Plan(torchrun=[*cmd, *torchrun_opts, script, *ns.training_script_args],
                nnodes=nnodes, node_rank=ns.node_rank, nproc=nproc, world=nnodes * nproc,
                collector=collector, bind=bind, node=node, run_id=run_id, opts=opts)


def die_with_parent() -> None:
    """Children get SIGTERM if the launcher is killed outright (Linux), never orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


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

    def wait_ready(self, timeout: float) -> bool:
        pid = _wait_file(self.ready, self.proc, timeout)
        if pid is not None:
            log(f"relay pid {pid} serves this node" if pid not in ("", "0") else
                "another relay already serves this node's run")
        return pid is not None

    def stop(self, timeout: float) -> None:
        wait_then_stop(self.proc, timeout, f"the relay had not delivered everything after "
                                           f"{timeout:g} s; stopping it")


def bootstrap(tmp: Path) -> Path:
    """The directory with the ``sitecustomize`` that patches every rank."""
    here = tmp / "boot"
    here.mkdir()
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    (here / "sitecustomize.py").write_text(SITECUSTOMIZE.format(pkg_parent=pkg_parent,
                                                                here=str(here)))
    return here


def rank_env(plan: Plan, boot: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["COMMCHECK_COLLECTOR"] = plan.collector
    env["COMMCHECK_RUN_ID"] = plan.run_id
    if plan.opts.curve_dir:
        env["COMMCHECK_CURVE_DIR"] = plan.opts.curve_dir
    env[BOOT_MARK] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot), env.get("PYTHONPATH")) if p)
    return env


def relay_environment(ranks: dict[str, str]) -> dict[str, str]:
    """The ranks' environment without the bootstrap (the relay is never patched), with
    the user's own PYTHONPATH: the commcheck the launcher runs is the one the relay runs."""
    env = {k: v for k, v in ranks.items() if k not in (BOOT_MARK, "PYTHONPATH")}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def run_training(cmd: list[str], env: dict[str, str], fwd: Forwarder) -> int:
    if fwd.signalled:
        log(f"signal {fwd.signalled} came before training started; not starting it")
        return 128 + fwd.signalled
    log(f"starting {' '.join(cmd)}")
    try:
        fwd.child = subprocess.Popen(cmd, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)
    except OSError as e:
        raise LaunchError(f"cannot start torchrun: {e}") from None
    rc = status(fwd.child.wait())
    log(f"torchrun exited with status {rc}")
    return rc


def prebuild() -> dict[str, str]:
    """The C++ DDP hook built before torchrun (one line while it builds, nothing when it is
    built); the ranks' environment names the private directory it is in."""
    from .native import prebuild, private

    hook = prebuild.ddp_hook(log)
    return {} if hook is None else {private.ENV: str(hook.parent)}


def launch(plan: Plan) -> int:
    fwd = Forwarder()
    with tempfile.TemporaryDirectory(prefix="commcheck-run-") as tmpname:
        tmp = Path(tmpname)
        native = prebuild()
        collector = None
        if plan.bind:
            collector = CollectorProcess(plan, tmp, run_keys(plan, tmp))
            plan.collector = collector.start(plan.opts.start_timeout)
            log(f"collector pid {collector.proc.pid} listening on {plan.collector}, db "
                f"{collector.db}")
        env = {**rank_env(plan, bootstrap(tmp)), **native}
        relay_env = relay_environment(env)
        relay = RelayProcess(plan, relay_env, tmp) if plan.node >= 0 else None
        if relay is not None and not relay.wait_ready(plan.opts.start_timeout):
            log("the relay did not start (its line above says why); the ranks start their own")
        try:
            rc = run_training(plan.torchrun, env, fwd)
        except LaunchError:
            if collector is not None:
                collector.stop(0)
            raise
        timeout = min(plan.opts.stop_timeout, SIGNALLED_STOP_TIMEOUT) if fwd.signalled \
            else plan.opts.stop_timeout
        t0 = time.monotonic()
        if relay is not None:
            relay.stop(timeout)
        if collector is None:
            if plan.node_rank == 0:
                log(f"records went to the collector at {plan.collector}; the report is its")
            return rc
        report_rc = collector.stop(max(0.0, timeout - (time.monotonic() - t0)))
    if report_rc not in (0, 1, 3):
        log(f"the collector ended with status {report_rc}; the report from {collector.db}:")
        report_rc = collector.report()
    return rc or report_rc


def main(argv: list[str]) -> int:
    try:
        plan = parse(argv, dict(os.environ))
        return launch(plan)
    except LaunchError as e:
        print(f"commcheck run: error: {e}", file=sys.stderr, flush=True)
        return 2


def finish(rc: int) -> NoReturn:
    """End ``commcheck run`` now: its children are waited for and its temporary directory is
    gone, but the torch it imported for torchrun's parser takes a second of teardown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)
