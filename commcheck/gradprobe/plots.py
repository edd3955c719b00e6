"""PNG line plots of per-step similarities.

Uses ``matplotlib.figure.Figure`` with the Agg canvas directly instead of ``pyplot``: no global
backend switch in the user's process, no shared "current figure", safe off the main thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def save_line_plot(
    path: str,
    steps: Sequence[int],
    values: Sequence[float],
    title: str,
    ylabel: str = "similarities",
    threshold: float | None = None,
) -> None:
    """One line over steps, labelled like msprobe's plots, optionally with a threshold line."""
    fig = Figure(figsize=(6.4, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(list(steps), list(values), marker="o" if len(steps) < 50 else None)
    if threshold is not None:
        ax.axhline(threshold, color="tab:red", linestyle="--", linewidth=1)
    ax.set_xlabel("steps")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.savefig(path, format="png")
