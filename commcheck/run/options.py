"""``commcheck run``'s command line: commcheck's options and torchrun's, then the script's.

Read by hand, not by typer: commcheck's options sit among torchrun's, and only a parser that
knows which of torchrun's options take a value can tell where the script starts (click
treats an unknown option's value as the first argument; docs/startup.md). Torch's own
parser knows exactly, but reaching it imports torch (~1.7 s of CPU before anything starts),
so a plain command line is read with a table of torchrun's options, which
``tests/unit/test_run_options.py`` checks against this torch's parser. Whatever the table
cannot decide (an option it does not know, an abbreviation, ``--help``, ``PET_*`` defaults,
``--nproc-per-node gpu``) goes to torch's parser, as every command line once did.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, fields

from . import LaunchError

PY = sys.executable
DEFAULT_COLLECTOR_PORT = 5555


def _opt(default: object, text: str):
    return field(default=default, metadata={"help": text})


@dataclass
class RunOptions:
    """commcheck's own options: before SCRIPT; everything else there goes to torchrun."""

    db: str = _opt("", "collector database (default: runs/commcheck-<time>.db)")
    hang_timeout: float = _opt(30.0, "seconds a collective may wait for missing members "
                                     "(collect's)")
    curve_dir: str = _opt("", "CURVE keys from `commcheck keygen` (default: "
                              "$COMMCHECK_CURVE_DIR)")
    collector: str = _opt("", "ZeroMQ endpoint of a running `commcheck collect`: start none, "
                              "send there (default on node rank > 0: node 0's, "
                              "tcp://MASTER_ADDR:PORT)")
    collector_port: int = _opt(0, f"port node 0's collector binds (default: "
                                  f"{DEFAULT_COLLECTOR_PORT} with several nodes, a free "
                                  f"loopback port with one)")
    metrics: str = _opt("", "collect's --metrics: serve Prometheus metrics on HOST:PORT "
                            "(bare PORT: loopback)")
    straggler: str = _opt("", "collect's --straggler: when a rank is a straggler "
                              "(key=value,... or off)")
    stop_timeout: float = _opt(30.0, "seconds to wait for delivery and every goodbye after "
                                     "torchrun exits")
    start_timeout: float = _opt(60.0, "seconds to wait for the collector and relay to start")
    torchrun: str = _opt("", "torchrun executable (default: python -m torch.distributed.run)")


OWN = {f"--{f.name.replace('_', '-')}": f for f in fields(RunOptions)}
_CONVERT = {"str": str, "int": int, "float": float}

# torchrun's options by whether they take a value (torch.distributed.run.get_args_parser)
TORCHRUN_FLAGS = frozenset({
    "--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path",
    "--run_path", "--virtual-local-rank", "--virtual_local_rank"})
TORCHRUN_VALUED = frozenset({
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend",
    "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf",
    "--rdzv_conf", "--max-restarts", "--max_restarts", "--monitor-interval",
    "--monitor_interval", "--start-method", "--start_method", "--event-log-handler",
    "--event_log_handler", "--role", "--log-dir", "--log_dir", "-r", "--redirects", "-t",
    "--tee", "--local-ranks-filter", "--local_ranks_filter", "--duplicate-stdout-filters",
    "--duplicate_stdout_filters", "--duplicate-stderr-filters", "--duplicate_stderr_filters",
    "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
    "--master_port", "--local-addr", "--local_addr", "--logs-specs", "--logs_specs",
    "--numa-binding", "--numa_binding", "--signals-to-handle", "--signals_to_handle",
    "--shutdown-timeout", "--shutdown_timeout"})


@dataclass
class Torchrun:
    """What commcheck needs of torchrun's command line (torchrun's defaults)."""

    tokens: list[str]  # torchrun's options as given, commcheck's taken out
    script: str
    script_args: list[str]
    nnodes: str = "1:1"
    nproc_per_node: str = "1"
    node_rank: int = 0
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    standalone: bool = False
    module: bool = False
    no_python: bool = False


_NAMES = {f.name for f in fields(Torchrun)}


def _dest(option: str) -> str:
    return {"-m": "module"}.get(option, option.lstrip("-").replace("-", "_"))


def read_plainly(argv: list[str]) -> tuple[dict[str, str], Torchrun] | None:
    """(commcheck's option values, torchrun's) read with the table; None where only torch's
    parser can decide."""
    own: dict[str, str] = {}
    tokens: list[str] = []
    got: dict[str, object] = {}
    i = 0
    while i < len(argv):
        t = argv[i]
        if t == "--" or not t.startswith("-") or t == "-":
            rest = argv[i + 1:] if t == "--" else argv[i:]
            if not rest or rest[0] == "-":
                return None
            return own, Torchrun(tokens, rest[0], rest[1:], **got)  # type: ignore[arg-type]
        name, eq, value = t.partition("=")
        if name in TORCHRUN_FLAGS and not eq:
            tokens.append(t)
            got[_dest(name)] = True
            i += 1
            continue
        if name not in OWN and name not in TORCHRUN_VALUED:
            return None
        if not eq:
            if i + 1 == len(argv) or argv[i + 1].startswith("-"):
                return None
            value = argv[i + 1]
        taken = argv[i:i + (1 if eq else 2)]
        i += len(taken)
        if name in OWN:
            own[OWN[name].name] = value
            continue
        tokens += taken
        dest = _dest(name)
        if dest in _NAMES:
            if dest in ("node_rank", "master_port"):
                if not value.isdigit():
                    return None
                got[dest] = int(value)
            else:
                got[dest] = value
    return None


def _torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (this torch's options, exactly), plus commcheck's."""
    try:
        from torch.distributed.run import get_args_parser
    except ImportError as e:
        raise LaunchError(f"torchrun is missing: cannot import torch.distributed.run ({e})") \
            from None
    p = get_args_parser()
    p.prog = "commcheck run"
    p.description = "torchrun with commcheck in every rank, the script untouched."

    def error(message: str):  # one line, no usage block
        raise LaunchError(message)

    p.error = error  # type: ignore[method-assign]
    g = p.add_argument_group("commcheck (before SCRIPT; everything else goes to torchrun)")
    for option, f in OWN.items():
        g.add_argument(option, dest=f"commcheck_{f.name}", metavar=f.name.upper(),
                       help=f.metadata["help"])
    return p


def read_by_torch(argv: list[str]) -> tuple[dict[str, str], Torchrun]:
    """The same as :func:`read_plainly`, by torchrun's own parser (imports torch)."""
    ns = _torchrun_parser().parse_args(argv)
    own = {f.name: v for f in OWN.values()
           if (v := getattr(ns, f"commcheck_{f.name}")) is not None}
    prefix = argv[:len(argv) - 1 - len(ns.training_script_args)]
    if prefix and prefix[-1] == "--":
        prefix = prefix[:-1]
    tokens, i = [], 0
    while i < len(prefix):
        name, eq, _ = prefix[i].partition("=")
        step = 1 if eq or name not in OWN else 2
        if name not in OWN:
            tokens.append(prefix[i])
        i += step
    values = {k: getattr(ns, k) for k in _NAMES - {"tokens", "script", "script_args"}}
    return own, Torchrun(tokens, ns.training_script, ns.training_script_args, **values)


def own_options(values: dict[str, str], env: dict[str, str]) -> RunOptions:
    opts = RunOptions(curve_dir=env.get("COMMCHECK_CURVE_DIR", ""))
    for name, raw in values.items():
        f = next(f for f in fields(RunOptions) if f.name == name)
        try:
            setattr(opts, name, _CONVERT[str(f.type)](raw))
        except ValueError:
            raise LaunchError(f"argument --{name.replace('_', '-')}: invalid {f.type} value: "
                              f"{raw!r}") from None
    return opts


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
    opts: RunOptions
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


def _nproc(value: str) -> int:
    if value.isdigit():
        return int(value)
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as e:
        raise LaunchError(f"--nproc-per-node {value}: {e}") from None


def _started_here(tokens: list[str], *names: str) -> bool:
    return any(t.replace("_", "-").startswith(n) for t in tokens for n in names)


def _torchrun_module() -> None:
    """torch.distributed.run is there to run, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    if not any(os.path.isfile(os.path.join(d, "distributed", "run.py")) for d in where):
        raise LaunchError("torchrun is missing: cannot import torch.distributed.run (no "
                          "torch with it on this Python's path)")


def _command(opts: RunOptions) -> list[str]:
    if not opts.torchrun:
        _torchrun_module()
        return [PY, "-m", "torch.distributed.run"]
    exe = shutil.which(opts.torchrun)
    if exe is None:
        raise LaunchError(f"--torchrun {opts.torchrun}: torchrun is missing (no such "
                          f"executable)")
    return [exe]


def parse(argv: list[str], env: dict[str, str]) -> Plan:
    plain = None if any(k.startswith("PET_") for k in env) else read_plainly(argv)
    values, tr = plain if plain is not None else read_by_torch(argv)
    opts = own_options(values, env)
    if not (tr.module or tr.no_python) and not os.path.isfile(tr.script):
        raise LaunchError(f"{tr.script}: no such script")
    nnodes = _nnodes(tr.nnodes)
    nproc = _nproc(tr.nproc_per_node)
    if not 0 <= tr.node_rank < nnodes:
        raise LaunchError(f"--node-rank {tr.node_rank}: need 0 <= node rank < --nnodes")
    cmd, torchrun_opts = _command(opts), tr.tokens
    static = tr.rdzv_backend == "static" and not tr.standalone
    if nnodes == 1 and not _started_here(torchrun_opts, "--master-port", "--rdzv-",
                                         "--standalone"):
        torchrun_opts = ["--standalone", *torchrun_opts]  # no clash on port 29500
        static = False
    node = tr.node_rank if static else (0 if nnodes == 1 else -1)
    host = tr.master_addr if static or not tr.rdzv_endpoint else \
        tr.rdzv_endpoint.rsplit(":", 1)[0]
    port = opts.collector_port or DEFAULT_COLLECTOR_PORT
    bind = ""
    if opts.collector:
        collector = opts.collector
    elif tr.node_rank == 0:
        bind = f"tcp://127.0.0.1:{opts.collector_port or '*'}" if nnodes == 1 \
            else f"tcp://0.0.0.0:{port}"
        collector = ""  # known once it listens
    else:
        collector = f"tcp://{host}:{port}"
    run_id = env.get("COMMCHECK_RUN_ID", "")
    if not run_id:
        run_id = tr.rdzv_id if tr.rdzv_id not in ("", "none") else \
            f"{host}:{tr.master_port or 29500}" if nnodes > 1 else \
            f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return Plan(torchrun=[*cmd, *torchrun_opts, tr.script, *tr.script_args],
                nnodes=nnodes, node_rank=tr.node_rank, nproc=nproc, world=nnodes * nproc,
                collector=collector, bind=bind, node=node, run_id=run_id, opts=opts)
