"""``commcheck grad ...`` commands (a typer sub-app mounted by the main CLI)."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

from commcheck.gradprobe import layout
from commcheck.gradprobe.compare import DEFAULT_THRESHOLD, GradComparator
from commcheck.gradprobe.errors import GradProbeError
from commcheck.gradprobe.report import render

grad_app = typer.Typer(
    help="Gradient probe: compare msprobe-layout gradient dumps.",
    no_args_is_help=True,
    add_completion=False,
)
EXIT_BAD_INPUT = 2


@grad_app.callback()
def _group() -> None:
    """Keeps ``compare`` a subcommand even while it is the only one."""


def _is_rank_dir(path: str) -> bool:
    names = os.listdir(path) if os.path.isdir(path) else []
    return any(n.startswith(layout.SUMMARY_PREFIX) or n.startswith("step") for n in names)


@grad_app.command("compare")
def compare(
    run_a: str = typer.Argument(..., help="dump_path of the first run (or one rank<N> directory)"),
    run_b: str = typer.Argument(..., help="dump_path of the second run (or one rank<N> dir)"),
    out: str = typer.Argument(..., help="output directory (created if missing)"),
    threshold: float = typer.Option(DEFAULT_THRESHOLD, help="flag similarities below this"),
    top: int = typer.Option(10, help="parameters to list per rank in the terminal summary"),
) -> None:
    """Compare two runs step by step: similarities.csv, plots, stat_diffs.csv, summary."""
    if not 0.0 <= threshold <= 1.0:
        _fail(f"--threshold must lie within [0, 1], got {threshold}")
    try:
        if _is_rank_dir(run_a) and _is_rank_dir(run_b):
            single = GradComparator.compare(run_a, run_b, out, threshold)
            results = {single.label: single}
        else:
            per_rank = GradComparator.compare_distributed(run_a, run_b, out, threshold)
            results = {f"rank{r}": res for r, res in per_rank.items()}
    except GradProbeError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{exc.filename or out}: {exc.strerror or exc}")
    render(results, Console(), limit=top)


def _fail(message: str) -> None:
    print(f"commcheck grad compare: error: {message}", file=sys.stderr)
    raise typer.Exit(EXIT_BAD_INPUT)
