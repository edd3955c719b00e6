"""The ``commcheck`` command. Every error is one line on stderr and exit status 2."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Check every collective of a torch.distributed job, out of band.")


def _mount_subcommands() -> None:
    from .gradprobe.cli import grad_app

    app.add_typer(grad_app, name="grad")


_mount_subcommands()


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


@app.command()
def collect(
    bind: Annotated[str, typer.Option(help="ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555")],
    world_size: Annotated[int, typer.Option(min=1, help="Number of ranks in the job")],
    db: Annotated[str, typer.Option(help="SQLite file for records and findings")],
    exit_when_done: Annotated[bool, typer.Option(help="Exit once every rank said goodbye")] =
    False,
    idle_timeout: Annotated[float, typer.Option(min=0, help="Exit after S seconds without "
                                                            "messages (0: never)")] = 0.0,
    live: Annotated[bool | None, typer.Option(help="Live view (default: on a terminal)")] =
    None,
    ready_file: Annotated[str, typer.Option(help="Write the bound endpoint here once "
                                                 "listening")] = "",
    hang_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds a collective may wait "
                                                             "for missing members before "
                                                             "missing_rank")] = 30.0,
) -> None:
    """Receive records from the ranks, check them live, store them, print the report."""
    import zmq

    from .collector import Collector, CollectorOptions
    from .store import StoreError

    opts = CollectorOptions(bind=bind, world_size=world_size, db=db,
                            exit_when_done=exit_when_done, idle_timeout=idle_timeout, live=live,
                            ready_file=ready_file, hang_timeout=hang_timeout)
    try:
        collector = Collector(opts)
    except StoreError as e:
        raise CliError(str(e)) from None
    except zmq.ZMQError as e:
        raise CliError(f"cannot bind {bind}: {e}") from None
    raise typer.Exit(collector.run())


@app.command()
def report(
    path: Annotated[str, typer.Argument(help="Database written by `commcheck collect`")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout")] =
    False,
) -> None:
    """Show the findings of a run; exit 1 when there are any."""
    from .report import build_summary, render, to_json
    from .store import Store, StoreError

    try:
        store = Store.open(path)
        findings = store.findings()
        summary = build_summary(findings, store.summary())
    except StoreError as e:
        raise CliError(str(e)) from None
    if as_json:
        sys.stdout.write(json.dumps(to_json(findings, summary), indent=2) + "\n")
    else:
        render(findings, summary)
    raise typer.Exit(1 if findings else 0)


@app.command()
def analyze(
    path: Annotated[str, typer.Argument(help="Dump directory (COMMCHECK_DUMP_DIR) or one file")],
    db: Annotated[str, typer.Option(help="Keep records and findings in this new SQLite "
                                         "file")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout")] =
    False,
    hang_timeout: Annotated[float, typer.Option(min=0.1, help="As for collect")] = 30.0,
) -> None:
    """Run the engine over per-rank dump files and print the report; exit 1 on findings."""
    import tempfile
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress

    from .analyze import AnalyzeError, total_bytes
    from .analyze import analyze as run_analysis
    from .report import build_summary, render, to_json
    from .store import Store, StoreError

    with tempfile.TemporaryDirectory(prefix="commcheck-analyze-") as tmp:
        target = Path(db) if db else Path(tmp) / "analysis.db"
        if db and target.exists():
            raise CliError(f"{db}: already exists; analyze writes a new database")
        try:
            size = total_bytes(path)
            store = Store.create(target)
            with Progress(console=Console(stderr=True), transient=True,
                          disable=size < (32 << 20)) as bar:
                task = bar.add_task("analysing dumps", total=size)
                run_analysis(path, store, hang_timeout, lambda n: bar.advance(task, n))
            findings = store.findings()
            summary = build_summary(findings, store.summary())
            store.close()
        except (AnalyzeError, StoreError) as e:
            raise CliError(str(e)) from None
        except OSError as e:
            raise CliError(f"{e.filename or path}: {e.strerror or e}") from None
    if as_json:
        sys.stdout.write(json.dumps(to_json(findings, summary), indent=2) + "\n")
    else:
        render(findings, summary)
    raise typer.Exit(1 if findings else 0)


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
    except Exception as e:
        if not hasattr(e, "format_message"):  # click's (or typer's vendored) usage errors
            raise
        print(f"commcheck: error: {e.format_message()}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
