"""``commcheck collect``'s options and the collector's :class:`CollectorOptions` say the same
defaults (the CLI takes them from the class: a default changed in one place changes both)."""

from __future__ import annotations

import dataclasses

import typer

from commcheck.cli import app
from commcheck.collector.options import DEFAULT_MAX_UNVERIFIED, CollectorOptions
from commcheck.engine import DEFAULT_HANG_TIMEOUT

NOT_ON_THE_CLI = {"commit_interval"}  # tuned by the collector itself; tests set it


def _defaults(command: str) -> dict[str, object]:
    """Option name -> default, as the built command (what ``--help`` and a run see)."""
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {p.name: p.default for p in cmd.params}


def test_collect_has_an_option_for_every_field_with_the_same_default():
    cli = _defaults("collect")
    fields = {f.name: f for f in dataclasses.fields(CollectorOptions)}
    assert set(cli) == set(fields) - NOT_ON_THE_CLI
    for name, default in cli.items():
        field = fields[name]
        want = None if field.default is dataclasses.MISSING else field.default
        assert default == want and type(default) is type(want), name


def test_report_and_analyze_say_the_collector_defaults():
    assert CollectorOptions.hang_timeout == DEFAULT_HANG_TIMEOUT  # the engine's own default
    assert _defaults("analyze")["hang_timeout"] == CollectorOptions.hang_timeout
    for command in ("collect", "report", "analyze"):
        assert _defaults(command)["max_unverified"] == DEFAULT_MAX_UNVERIFIED
