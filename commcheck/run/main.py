"""``commcheck run``: torchrun with commcheck in every rank, the script untouched.

Run once per node, with torchrun's options. On a single node or node rank 0 it starts
``commcheck collect`` for the whole job (unless ``--collector`` names one) and waits until
it listens; then it starts this node's relay and torchrun together, with a bootstrap
``sitecustomize`` first on the ranks' ``PYTHONPATH`` that holds each rank until the relay is
up (see :mod:`commcheck.rank.boot`); then it lets the relay deliver and the collector see
every goodbye (at most ``--stop-timeout`` s each) and prints the report once. Other nodes
run torchrun the same way, their ranks pointed at node 0's collector.

Exit status: torchrun's when training failed (128 + N for signal N), else the report's (0
clean, 1 findings, 3 unfinished); 2 for bad input, with one line on stderr. SIGTERM, SIGINT
and SIGHUP go to torchrun; the collector then gets a few seconds to finish.

This module puts the processes in order (:mod:`.processes`) and imports neither side of
commcheck: the launcher is a process manager, nothing more. The one exception is native
code made ready before training (:mod:`commcheck.native.prebuild`): the C++ DDP hook
is built here, before torchrun, so no rank waits on a compiler (docs/native.md).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from . import LaunchError, log
from .options import Plan, parse
from .processes import CollectorProcess, Forwarder, RelayProcess, die_with_parent, run_keys, status

SIGNALLED_STOP_TIMEOUT = 5.0
# The exit statuses with which `collect` has printed its report (collector/report.py: clean,
# findings, unfinished, training failed, unverified); any other means it printed none.
REPORT_STATUSES = (0, 1, 3, 4, 5)
LAST_WORDS_S = 2.0  # the collector's own ending once the only relay delivered and left
BOOT_MARK = "COMMCHECK_BOOT"  # commcheck.rank.boot.MARK
BOOT_HOLD = "COMMCHECK_BOOT_HOLD"  # commcheck.rank.boot.HOLD
SITECUSTOMIZE = """\
import sys
try:
    from commcheck.rank.boot import boot
except ImportError:
    sys.path.append({pkg_parent!r})
    from commcheck.rank.boot import boot
boot({here!r})
"""


def bootstrap(tmp: Path) -> Path:
    """The directory with the ``sitecustomize`` that patches every rank."""
    here = tmp / "boot"
    here.mkdir()
    pkg_parent = str(Path(__file__).resolve().parents[2])
    (here / "sitecustomize.py").write_text(SITECUSTOMIZE.format(pkg_parent=pkg_parent,
                                                                here=str(here)))
    return here


def rank_env(plan: Plan, boot: Path, hold: Path | None = None) -> dict[str, str]:
    """The ranks' environment; with ``hold``, each waits at its bootstrap until that file
    exists (at most ``--start-timeout`` s)."""
    env = dict(os.environ)
    env["COMMCHECK_COLLECTOR"] = plan.collector
    env["COMMCHECK_RUN_ID"] = plan.run_id
    if plan.opts.curve_dir:
        env["COMMCHECK_CURVE_DIR"] = plan.opts.curve_dir
    env[BOOT_MARK] = "1"
    if hold is not None:
        env[BOOT_HOLD] = f"{plan.opts.start_timeout!r}:{hold}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot), env.get("PYTHONPATH")) if p)
    return env


def relay_environment(ranks: dict[str, str]) -> dict[str, str]:
    """The ranks' environment without the bootstrap (the relay is never patched), with
    the user's own PYTHONPATH: the commcheck the launcher runs is the one the relay runs."""
    env = {k: v for k, v in ranks.items() if k not in (BOOT_MARK, BOOT_HOLD, "PYTHONPATH")}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def run_training(plan: Plan, env: dict[str, str], fwd: Forwarder,
                 relay: RelayProcess | None, hold: Path | None) -> int:
    """torchrun, started while the node's relay starts: its agent imports torch meanwhile,
    and the ranks wait at their bootstrap until the relay holds the run's lock (or said why
    it cannot), so that none looks for it before (docs/startup.md)."""
    if fwd.signalled:
        log(f"signal {fwd.signalled} came before training started; not starting it")
        return 128 + fwd.signalled
    log(f"starting {' '.join(plan.torchrun)}")
    try:
        fwd.child = subprocess.Popen(plan.torchrun, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)
    except OSError as e:
        raise LaunchError(f"cannot start torchrun: {e}") from None
    if relay is not None and not relay.wait_ready(plan.opts.start_timeout):
        log("the relay did not start (its line above says why); the ranks start their own")
    if hold is not None:
        os.close(os.open(hold, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    rc = status(fwd.child.wait())
    log(f"torchrun exited with status {rc}")
    return rc


def prebuild() -> dict[str, str]:
    """The C++ DDP hook built before torchrun (one line while it builds, nothing when it is
    built); the ranks' environment names the private directory it is in."""
    from ..native import prebuild, private

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
        boot = bootstrap(tmp)
        hold = boot / "release" if plan.node >= 0 else None
        env = {**rank_env(plan, boot, hold), **native}
        relay = RelayProcess(plan, relay_environment(env), tmp) if hold else None
        try:
            rc = run_training(plan, env, fwd, relay, hold)
        except LaunchError:
            if relay is not None:
                relay.proc.terminate()
            if collector is not None:
                collector.stop(0)
            raise
        timeout = min(plan.opts.stop_timeout, SIGNALLED_STOP_TIMEOUT) if fwd.signalled \
            else plan.opts.stop_timeout
        t0 = time.monotonic()
        relay_done = relay is not None and relay.stop(timeout)
        if collector is None:
            if plan.node_rank == 0:
                log(f"records went to the collector at {plan.collector}; the report is its")
            return rc
        left = max(0.0, timeout - (time.monotonic() - t0))
        if relay_done and plan.nnodes == 1:  # the only node's relay is gone: nothing more
            left = min(left, LAST_WORDS_S)  # will come (ranks that never started never will)
        report_rc = collector.stop(left)
    if report_rc not in REPORT_STATUSES:  # it printed no report: a failure, or killed
        why = collector.error()
        log(f"the collector ended with status {report_rc}" + (f" ({why})" if why else "") +
            f"; the report from {collector.db}:")
        report_rc = collector.report()
    elif rc == 0 and report_rc == 3 and collector.nobody_connected():
        log("torchrun exited 0 and no rank ever connected: the script made no "
            "torch.distributed call (no init_process_group), so there was nothing to check")
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
    gone, but a torch imported for torchrun's parser (a command line the plain read could not
    decide, :mod:`.options`) or for a build takes a second of teardown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)
