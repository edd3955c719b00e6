"""The relay's command line (``python -m commcheck.relay`` and ``commcheck relay``).

Its options are generated from :class:`~commcheck.wire.relay_settings.RelaySettings`, one
per field, each falling back to the field's environment variable (the rank side's
configuration keys), so a relay started in a job's environment needs only ``--run``.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from dataclasses import fields
from functools import cache
from typing import Annotated

import typer

from ..wire.keys import SecurityError
from ..wire.relay_settings import RelaySettings, flag
from ..wire.ring import RingError, open_private
from .relay import Relay

_KINDS = {"str": str, "int": int, "float": float}
HELP = ("Ship the records of one run's ranks on this node (their ring files) to the "
        "collector, or to dump files; exit when they are done.")


def _parameters() -> list[inspect.Parameter]:
    out = []
    for f in fields(RelaySettings):
        meta = f.metadata
        option = typer.Option(flag(f), help=meta["help"], envvar=meta["env"] or None,
                              hidden=meta["hidden"])
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                     annotation=Annotated[_KINDS[str(f.type)], option]))
    return out


@cache
def command():  # noqa: ANN201 (typer's own click command type)
    """The ``commcheck relay`` command: its options are the settings' fields."""
    def relay(**values: object) -> RelaySettings:
        return RelaySettings(**values)  # type: ignore[arg-type]

    params = _parameters()
    relay.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    relay.__annotations__ = {p.name: p.annotation for p in params}
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(help=HELP)(relay)
    return typer.main.get_command(app)


def parse(argv: list[str]) -> RelaySettings | int:
    """The settings ``argv`` (and the environment) give; an int: the exit status, the
    reason said (``--help``, or one line for a bad option)."""
    try:
        got = command().main(args=argv, prog_name="commcheck relay", standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        return 2
    except Exception as e:
        if not hasattr(e, "format_message"):  # typer's (vendored click's) usage errors
            raise
        print(f"commcheck relay: error: {e.format_message()}", file=sys.stderr)
        return 2
    return got if isinstance(got, RelaySettings) else int(got or 0)


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else list(argv))
    if isinstance(opts, int):
        return opts
    if not opts.run:
        print("commcheck relay: error: --run (or COMMCHECK_RUN_ID) is required", file=sys.stderr)
        return 2
    if not opts.collector and not opts.dump_dir:
        print("commcheck relay: error: --collector or --dump-dir is required", file=sys.stderr)
        return 2
    try:
        relay = Relay(opts)
        stream = sys.stderr
        if opts.log:
            path = relay.log_path if opts.log == "auto" else opts.log
            stream = os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a")
        logging.basicConfig(level=logging.INFO, stream=stream,
                            format="%(asctime)s commcheck-relay[%(process)d] %(message)s")
        return relay.run(opts.ready_file)
    except (SecurityError, RingError, OSError) as e:
        print(f"commcheck relay: error: {e}", file=sys.stderr)
        return 2
