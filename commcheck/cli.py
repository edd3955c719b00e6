"""The ``commcheck`` command. Every error is one line on stderr and exit status 2."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from .collector.options import DEFAULT_MAX_UNVERIFIED, CollectorOptions

if TYPE_CHECKING:
    from .engine import Finding, Summary

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Check every collective of a torch.distributed job, out of band.")


def _mount_subcommands() -> None:
    from .gradprobe.cli import grad_app

    app.add_typer(grad_app, name="grad")


_mount_subcommands()


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# collect, report, analyze: the unverified share above which a run is not clean (status 5)
MaxUnverified = Annotated[float, typer.Option(
    min=0.0, max=1.0, envvar="COMMCHECK_MAX_UNVERIFIED", help=(
        "Exit 5 (too little verified to call it clean) when more than this share of the "
        "collectives went unverified because ranks dropped records (docs/report-status.md)"))]

STRAGGLER_HELP = (
    "When a rank is a straggler: key=value,... of window (collectives, 64), majority (share "
    "of the others' waiting for it, 0.6), cost (share of their wall time, 0.05), link_factor "
    "(4); or off (default: $COMMCHECK_STRAGGLER, else the key straggler of $COMMCHECK_CONFIG)")


@app.command()
def collect(
    bind: Annotated[str, typer.Option(help="ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555")],
    world_size: Annotated[int, typer.Option(min=1, help="Number of ranks in the job")],
    db: Annotated[str, typer.Option(help="SQLite file for records and findings")],
    exit_when_done: Annotated[bool, typer.Option(help=(
        "Exit once every rank said goodbye, died, or went silent: ranks never heard of "
        "again (a lost node, a refused key) are waited for at most --done-wait seconds "
        "after the others finished or the first refusal"))] = CollectorOptions.exit_when_done,
    done_wait: Annotated[float, typer.Option(min=0, help=(
        "With --exit-when-done: seconds of silence from the unfinished ranks before "
        "giving up on them"))] = CollectorOptions.done_wait,
    idle_timeout: Annotated[float, typer.Option(min=0, help="Exit after S seconds without "
                                                            "messages (0: never)")] =
    CollectorOptions.idle_timeout,
    live: Annotated[bool | None, typer.Option(help="Live view (default: on a terminal)")] =
    CollectorOptions.live,
    ready_file: Annotated[str, typer.Option(help="Write the bound endpoint here once "
                                                 "listening")] = CollectorOptions.ready_file,
    hang_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds a collective may wait "
                                                             "for missing members before "
                                                             "missing_rank")] =
    CollectorOptions.hang_timeout,
    curve_dir: Annotated[str, typer.Option(help="Accept only CURVE senders holding a client "
                                                "key of DIR/clients (see keygen)")] =
    CollectorOptions.curve_dir,
    records: Annotated[str, typer.Option(help="Keep records in DB.records, the batches as "
                                              "received (file: read with `commcheck "
                                              "records`), as SQL rows (rows: ~10x slower), "
                                              "as blobs in the database (batches) or not "
                                              "at all (none)")] = CollectorOptions.records,
    shards: Annotated[int, typer.Option(min=1, help="Engine processes; batches are routed by "
                                                    "group identity")] = CollectorOptions.shards,
    keep_bodies: Annotated[bool, typer.Option(help="Also keep every message body (the "
                                                   "database then grows with the run; "
                                                   "analyze reads a sharded collector's "
                                                   "database from them)")]
    = CollectorOptions.keep_bodies,
    metrics: Annotated[str, typer.Option(help="Serve Prometheus metrics on HOST:PORT "
                                              "(bare PORT: 127.0.0.1); off by default")] =
    CollectorOptions.metrics,
    new_keys: Annotated[bool, typer.Option(help="First write fresh CURVE keys into "
                                                "--curve-dir (commcheck run's)")] =
    CollectorOptions.new_keys,
    fresh: Annotated[bool, typer.Option(help="Refuse a --db holding a run")] =
    CollectorOptions.fresh,
    max_unverified: MaxUnverified = CollectorOptions.max_unverified,
    straggler: Annotated[str, typer.Option(help=STRAGGLER_HELP)] = CollectorOptions.straggler,
) -> None:
    """Receive records from the ranks, check them live, store them, print the report. Exit
    status as for `report`."""
    from .collector.gate import insecure_bind_warning
    from .collector.store import StoreError

    bad_metrics = _check_collect_outputs(ready_file, metrics)
    straggler = _straggler_rules(straggler)
    opts = CollectorOptions(bind=bind, world_size=world_size, db=db,
                            exit_when_done=exit_when_done, done_wait=done_wait,
                            idle_timeout=idle_timeout, live=live,
                            ready_file=ready_file, hang_timeout=hang_timeout,
                            curve_dir=curve_dir, records=records, shards=shards,
                            keep_bodies=keep_bodies, metrics=metrics,
                            new_keys=new_keys, fresh=fresh,
                            max_unverified=max_unverified, straggler=straggler)
    collector = _new_collector(opts, bad_metrics)
    warning = insecure_bind_warning(bind, curve_dir)
    if warning:
        print(warning, file=sys.stderr)
    try:
        raise typer.Exit(collector.run())
    except StoreError as e:  # the database or records file could no longer be written
        raise CliError(str(e)) from None


def _new_collector(opts: CollectorOptions, bad_metrics: tuple[type[Exception], ...]):
    """The collector bound and its database open, or one line saying why not."""
    import zmq

    from .collector.daemon import Collector, StartError
    from .collector.snapshot import SnapshotError
    from .collector.store import StoreError, cannot_write
    from .wire.keys import SecurityError

    try:
        return Collector(opts)
    except (StoreError, SecurityError, StartError, *bad_metrics) as e:
        raise CliError(str(e)) from None
    except SnapshotError as e:
        raise CliError(f"{opts.db}: {e}") from None
    except zmq.ZMQError as e:
        raise CliError(f"cannot bind {opts.bind}: {e}") from None
    except sqlite3.Error as e:  # a full disk before the first commit
        raise CliError(cannot_write(opts.db, e)) from None


def _check_collect_outputs(ready_file: str, metrics: str) -> tuple[type[Exception], ...]:
    """One line for a ready file that cannot be written or a bad metrics address; the
    exporter's errors to expect (prometheus_client is imported only when metrics are
    served: a shorter start)."""
    ready_dir = os.path.dirname(os.path.abspath(ready_file))
    if ready_file and not (os.path.isdir(ready_dir) and os.access(ready_dir, os.W_OK)):
        raise CliError(f"--ready-file {ready_file}: no writable directory {ready_dir}")
    if not metrics:
        return ()
    from .collector.metrics import MetricsError, parse_address

    try:
        parse_address(metrics)
    except MetricsError as e:
        raise CliError(str(e)) from None
    return (MetricsError,)


def _straggler_rules(given: str) -> str:
    """The straggler spec: the option, else $COMMCHECK_STRAGGLER, else the ``straggler`` key
    of the ranks' JSON config file ($COMMCHECK_CONFIG; a file the collector cannot read is
    left to the ranks to refuse). Checked here: a bad one is one line."""
    from .engine.stragglers import RulesError, StragglerRules

    spec, where = given, "--straggler"
    if not spec and os.environ.get("COMMCHECK_STRAGGLER"):
        spec, where = os.environ["COMMCHECK_STRAGGLER"], "$COMMCHECK_STRAGGLER"
    path = os.environ.get("COMMCHECK_CONFIG", "")
    if not spec and path:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict) and "straggler" in data:
            spec, where = data["straggler"], f"{path}"
            if not isinstance(spec, str):
                raise CliError(f"{path}: straggler must be a string like 'window=64,cost=0.05'")
    try:
        StragglerRules.parse(spec)
    except RulesError as e:
        raise CliError(f"{where}: {e}") from None
    return spec


@app.command()
def keygen(
    directory: Annotated[str, typer.Argument(help="Key directory (created, mode 0700)")],
    force: Annotated[bool, typer.Option(help="Replace existing keys")] = False,
) -> None:
    """Write a CURVE server and client key pair for collect --curve-dir / COMMCHECK_CURVE_DIR."""
    from .wire.keys import SecurityError
    from .wire.keys import keygen as write_keys

    try:
        paths = write_keys(directory, force)
    except SecurityError as e:
        raise CliError(str(e)) from None
    for p in paths:
        print(p)


@app.command()
def report(
    path: Annotated[str, typer.Argument(help="Database written by `commcheck collect`")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout")] =
    False,
    html: Annotated[str, typer.Option("--html", help="Also write the report as one "
                                                    "self-contained web page, with figures")]
    = "",
    max_unverified: MaxUnverified = DEFAULT_MAX_UNVERIFIED,
) -> None:
    """Show the findings of a run. Exit 0: clean; 1: findings; 3: the run did not finish (a
    rank never said goodbye) or recorded nothing; 4: training failed (a rank's goodbye said
    so); 5: too little verified to call it clean (docs/report-status.md)."""
    from .collector.report import load
    from .collector.store import Store, StoreError

    try:
        store = Store.open(path)
        findings, summary = load(store)
        if html:
            _write_html(store, findings, summary, path, html)
    except StoreError as e:
        raise CliError(str(e)) from None
    except sqlite3.DatabaseError as e:
        raise CliError(f"{path}: corrupt database ({e})") from None
    _show(findings, summary, as_json, max_unverified)


def _write_html(store, findings: list[Finding], summary: Summary, db: str, output: str) -> None:
    """The HTML report into ``output``, one line on stderr saying so."""
    from .collector.html import write_html

    try:
        size = write_html(store, findings, summary, output, os.path.basename(db))
    except OSError as e:
        raise CliError(f"{output}: cannot write the report ({e.strerror or e})") from None
    print(f"{output}: {size / 1e3:.0f} kB, self-contained", file=sys.stderr)


@app.command()
def records(
    path: Annotated[str, typer.Argument(help="Database written by `commcheck collect` or "
                                             "`analyze --db`")],
    sql: Annotated[str, typer.Option(help="Query over the table `records` (one row per "
                                          "record, the columns of --records rows)")] =
    "SELECT * FROM records",
    run: Annotated[str | None, typer.Option(help="Only this run's records")] = None,
    rank: Annotated[int | None, typer.Option(help="Only this rank's records")] = None,
) -> None:
    """Query the records a database kept, whatever its --records mode: tab-separated rows
    with a header (chunks as hex)."""
    from .collector.store import Store, StoreError

    try:
        conn = Store.open(path).query(run, rank)
        cur = conn.execute(sql)
        print("\t".join(d[0] for d in cur.description or ()))
        for row in cur:
            print("\t".join(v.hex() if isinstance(v, bytes) else str(v) for v in row))
    except StoreError as e:
        raise CliError(str(e)) from None
    except sqlite3.DatabaseError as e:
        raise CliError(f"{path}: {e}") from None


@app.command()
def trace(
    path: Annotated[str, typer.Argument(help="Database written by `commcheck collect` or "
                                             "`analyze --db`")],
    output: Annotated[str, typer.Option("-o", "--output", help="Trace file to write (Chrome "
                                                              "trace-event JSON)")],
    first: Annotated[int | None, typer.Option("--from", help="First training step")] = None,
    last: Annotated[int | None, typer.Option("--to", help="Last training step")] = None,
) -> None:
    """Write a run as a Chrome trace (Perfetto, chrome://tracing): a track per rank, a slice
    per collective, findings as instant events, calls never completed left open."""
    from .collector.store import Store, StoreError

    try:
        store = Store.open(path)
    except StoreError as e:
        raise CliError(str(e)) from None
    _write_trace(store, path, output, first, last)


def _write_trace(store, db: str, output: str, first: int | None, last: int | None) -> None:
    """The trace of ``store`` into ``output``, its size line on stderr."""
    from .collector.calls import Steps
    from .collector.store import StoreError
    from .collector.trace import write_trace_file

    if first is not None and last is not None and first > last:
        raise CliError(f"--from {first} is after --to {last}")
    try:
        stats = write_trace_file(store, output, Steps(first, last))
    except StoreError as e:
        raise CliError(str(e)) from None
    except sqlite3.DatabaseError as e:
        raise CliError(f"{db}: corrupt database ({e})") from None
    except OSError as e:
        raise CliError(f"{output}: cannot write the trace ({e.strerror or e})") from None
    print(stats.line(output), file=sys.stderr)


def _show(findings: list[Finding], summary: Summary, as_json: bool,
          max_unverified: float) -> None:
    """Print a report (rich, or JSON alone on stdout) and exit with its status (see
    ``report``)."""
    from .collector.report import exit_status, render, to_json

    if as_json:
        sys.stdout.write(json.dumps(to_json(findings, summary), indent=2) + "\n")
    else:
        render(findings, summary, max_unverified=max_unverified)
    raise typer.Exit(exit_status(findings, summary, max_unverified))


@app.command()
def analyze(
    sources: Annotated[list[str], typer.Argument(metavar="SRC",
        help="Dump, spill or ring files, directories of them (*.ccw, *.spill, *.ring, searched "
             "recursively), or collector databases; merged, each message once",
        show_default=False)],
    db: Annotated[str, typer.Option(help="Keep records and findings in this new SQLite "
                                         "file")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout")] =
    False,
    hang_timeout: Annotated[float, typer.Option(min=0.1, help="As for collect")] = \
        CollectorOptions.hang_timeout,
    trace_file: Annotated[str, typer.Option("--trace", help="Also write the run as a Chrome "
                                                            "trace (see `commcheck trace`)")]
    = "",
    max_unverified: MaxUnverified = DEFAULT_MAX_UNVERIFIED,
) -> None:
    """Run the engine over dump, spill and ring files and collector databases and print the
    report; exit status as for `report`. A message in several sources counts once (the rest
    are rejected as "duplicate")."""
    import tempfile
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress

    from .collector.analyze import FOREIGN, AnalyzeError, find_sources, total_bytes
    from .collector.analyze import analyze as run_analysis
    from .collector.file_writer import WriteFailed
    from .collector.report import load
    from .collector.store import Store, StoreError, cannot_write

    if db:
        _not_an_input(db, sources)
    with tempfile.TemporaryDirectory(prefix="commcheck-analyze-") as tmp:
        target = Path(db) if db else Path(tmp) / "analysis.db"
        if db and target.exists():
            raise CliError(f"{db}: already exists; analyze writes a new database")
        store = None
        try:
            found = find_sources(sources)
            for s in found:
                if s.kind == FOREIGN:  # counted in the report too ("not_ours")
                    print(f"commcheck analyze: skipped {s.why}", file=sys.stderr)
            size = total_bytes(found)
            store = Store.create(target)
            with Progress(console=Console(stderr=True), transient=True,
                          disable=size < (32 << 20)) as bar:
                task = bar.add_task("analysing dumps", total=size)
                run_analysis(found, store, hang_timeout, lambda n: bar.advance(task, n),
                             lambda line: bar.console.print(f"commcheck: warning: {line}",
                                                            markup=False, highlight=False,
                                                            soft_wrap=True))
            findings, summary = load(store)
            store.close()
            store = None
        except (AnalyzeError, StoreError) as e:
            _discard_output(store, target if db else None)
            raise CliError(str(e)) from None
        except (WriteFailed, sqlite3.OperationalError) as e:  # its own output: a full disk
            _discard_output(store, target if db else None)
            raise CliError(cannot_write(db or target, e)) from None
        except OSError as e:
            _discard_output(store, target if db else None)
            raise CliError(f"{e.filename or ' '.join(sources)}: {e.strerror or e}") from None
        if trace_file:
            _write_trace(Store.open(target), str(target), trace_file, None, None)
    _show(findings, summary, as_json, max_unverified)


def _not_an_input(db: str, sources: list[str]) -> None:
    """--db names a new file: never one of the inputs (a collector database above all)."""
    for src in sources:
        same = os.path.realpath(db) == os.path.realpath(src)
        if not same and os.path.isfile(db) and os.path.isfile(src):
            try:
                same = os.path.samefile(db, src)
            except OSError:
                same = False
        if same:
            raise CliError(f"{db}: is also an input; --db names a new database for the "
                           f"analysis")


def _discard_output(store, target) -> None:
    """A failed analysis leaves no half-written --db behind (a rerun could not reuse it)."""
    import contextlib

    if store is not None:
        with contextlib.suppress(Exception):
            store.abandon()
    if target is not None:
        for suffix in ("", "-wal", "-shm", "-journal", ".records"):
            with contextlib.suppress(OSError):
                os.unlink(f"{target}{suffix}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def relay(ctx: typer.Context) -> None:
    """Ship the records of one run's ranks on this node to the collector (or dump files);
    usually started by the first rank or the launcher. `commcheck relay --help` for more."""
    from .relay.main import main as relay_main

    raise typer.Exit(relay_main(list(ctx.args)))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def run(ctx: typer.Context) -> None:
    """Run a training script under torchrun with every rank checked, unmodified: starts the
    collector (node rank 0) and the node's relay, prints the report. `commcheck run --help`
    for torchrun's and commcheck's options."""
    from .run.main import finish
    from .run.main import main as run_main

    finish(run_main(list(ctx.args)))


@app.command()
def build() -> None:
    """Build the native parts before training (for images; `commcheck run` does it too): the
    C++ DDP hook (torch's C++ ABI: about a minute, once per node and torch version), and say
    where the C kernel and the per-call path come from. Exit 1 where the hook cannot be
    built (the ranks then check DDP buckets with the Python hook)."""
    from .native import prebuild

    raise typer.Exit(prebuild.main(lambda line: print(f"commcheck build: {line}", flush=True)))


bench_app = typer.Typer(no_args_is_help=True, help="Measure commcheck itself.")
app.add_typer(bench_app, name="bench")


@bench_app.command("collector")
def bench_collector(
    ranks: Annotated[int, typer.Option(min=2, help="Simulated ranks")] = 1024,
    records: Annotated[int, typer.Option(min=1000, help="Records in all")] = 5_000_000,
    senders: Annotated[int, typer.Option(min=1, help="Sender processes")] = 2,
    shards: Annotated[int, typer.Option(min=1, help="Collector engine processes")] = 1,
    store: Annotated[str, typer.Option(help="Record persistence: file (collect's default), "
                                            "rows, batches or none")] = "file",
    mismatch: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of collectives "
                                                                   "with one wrong rank")] = 0.0,
    batch: Annotated[int, typer.Option(min=2, help="Records per batch")] = 512,
    repeat: Annotated[int, typer.Option(min=1, help="Runs (the median is reported)")] = 1,
    in_process: Annotated[bool, typer.Option(help="Also time decode + engine + store "
                                                  "without sockets")] = False,
    fsdp: Annotated[bool, typer.Option(help="TP-group calls alternate "
                                            "all_gather_into_tensor and "
                                            "reduce_scatter_tensor (FSDP-like, one chunk "
                                            "per member) instead of all_reduce")] = False,
    moe: Annotated[bool, typer.Option(help="TP-group calls are all_to_all_single "
                                           "(expert-parallel exchange, one input and one "
                                           "output chunk per member)")] = False,
    straggler: Annotated[str, typer.Option(help="The collector's --straggler (off: no "
                                                "arrival timing, to compare)")] = "",
) -> None:
    """Synthetic batches from sender processes into a real collector: records/s, memory."""
    import time

    from .collector.bench import Plan, run_collector, run_in_process, summary
    from .collector.store import RECORD_MODES
    from .engine.stragglers import RulesError, StragglerRules

    if store not in RECORD_MODES:
        raise CliError(f"--store {store}: expected one of {', '.join(RECORD_MODES)}")
    try:
        StragglerRules.parse(straggler)
    except RulesError as e:
        raise CliError(f"--straggler: {e}") from None
    results = []
    for i in range(repeat):
        plan = Plan(ranks=ranks, records=records, batch=batch, mismatch=mismatch, seed=i,
                    t0=time.time() + 3600, fsdp=fsdp, moe=moe)
        r = run_collector(plan, senders=senders, records_mode=store, shards=shards,
                          straggler=straggler)
        print(r.line(), flush=True)
        results.append(r)
        if in_process:
            print(run_in_process(plan, store).line(), flush=True)
    if repeat > 1:
        print(f"collector: {summary(results)}")


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered would fail again at exit."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    try:
        rc = app(args=argv, standalone_mode=False)
    except CliError as e:
        print(f"commcheck: error: {e}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        return 2
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as cat does
        _drop_stdout()
        return 1
    except OSError as e:  # the output cannot be written (a full disk)
        _drop_stdout()
        print(f"commcheck: error: cannot write the output ({e.strerror or e})",
              file=sys.stderr)
        return 2
    except Exception as e:
        if not hasattr(e, "format_message"):  # click's (or typer's vendored) usage errors
            raise
        print(f"commcheck: error: {e.format_message()}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
