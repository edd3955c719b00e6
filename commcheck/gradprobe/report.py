"""Rich terminal summary of a comparison: the parameters that diverge most, per rank."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from commcheck.gradprobe.compare import SUMMARY, RankComparison

NORM = 2


def worst_by_similarity(result: RankComparison, limit: int) -> list[tuple[str, float, int]]:
    """(param, lowest similarity, step of it), lowest first; the summary row is excluded."""
    worst = []
    for name, values in result.similarities.items():
        if name == SUMMARY or not values:
            continue
        low = min(values)
        worst.append((name, low, result.steps[values.index(low)]))
    return sorted(worst, key=lambda item: item[1])[:limit]


def worst_by_norm(result: RankComparison, limit: int) -> list[tuple[str, float, int]]:
    """(param, largest relative norm difference, step of it), largest first."""
    best: dict[str, tuple[float, int]] = {}
    for diff in result.stat_diffs:
        rel = diff.rel[NORM]
        key = -math.inf if math.isnan(rel) else rel
        if diff.name not in best or key > best[diff.name][0]:
            best[diff.name] = (rel, diff.step)
    ranked = sorted(best.items(), key=lambda kv: -kv[1][0] if not math.isnan(kv[1][0]) else 0)
    return [(name, rel, step) for name, (rel, step) in ranked[:limit]]


def render(results: dict[str, RankComparison], console: Console, limit: int = 10) -> None:
    for label, result in results.items():
        table = Table(title=f"{label}: {result.mode} comparison over {len(result.steps)} steps")
        table.add_column("parameter")
        if result.mode == "direction":
            summary = result.similarities.get(SUMMARY, [])
            table.add_column("min similarity", justify="right")
            table.add_column("at step", justify="right")
            table.add_column(f"first step < {result.threshold}", justify="right")
            for name, low, step in worst_by_similarity(result, limit):
                first = result.first_below.get(name)
                style = "red" if first is not None else None
                table.add_row(
                    name, f"{low:.4f}", str(step), "" if first is None else str(first), style=style
                )
            if summary:
                table.caption = f"summary similarity: min {min(summary):.4f}"
        else:
            table.add_column("max norm rel. diff", justify="right")
            table.add_column("at step", justify="right")
            for name, rel, step in worst_by_norm(result, limit):
                table.add_row(name, f"{rel:.3e}", str(step))
        console.print(table)
        console.print(f"outputs: {result.output_dir}")
