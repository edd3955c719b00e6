"""The HTML report's figures, drawn by matplotlib (its object API: no pyplot state, no
display) and returned as SVG text for the page to inline. Each takes what it draws, already
counted: the report's typed model (findings, summary) or :class:`OpRate` counted from the
records as they stream past."""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..engine import Finding
from .calls import Call

WIDTH = 7.5  # inches: the page's column
_MAX_BINS = 4000  # time bins the op rates keep; coarser bins beyond (a week-long run)


def svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue()


def findings_by_rank_step(findings: list[Finding], world: int = 0) -> Figure | None:
    """Each finding a mark at (step, culprit rank), coloured by kind; every rank of a
    ``world`` of up to 64 on the axis, so the clean ones show too."""
    points: dict[str, list[tuple[int, int]]] = {}
    for f in findings:
        for r in f.culprits:
            points.setdefault(str(f.kind), []).append((f.step, r))
    if not points:
        return None
    fig = Figure(figsize=(WIDTH, 3.2))
    ax = fig.add_subplot()
    for i, (kind, pts) in enumerate(sorted(points.items())):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=36, color=f"C{i}",
                   marker="osD^v<>ph"[i % 9], label=kind, zorder=3)
    ax.set(xlabel="training step", ylabel="culprit rank", title="findings by rank × step")
    ranks = sorted({r for pts in points.values() for _, r in pts})
    if 0 < world <= 64 and ranks[-1] < world:
        ranks = list(range(world))
    steps = sorted({s for pts in points.values() for s, _ in pts})
    ax.set_ylim(ranks[0] - 0.6, ranks[-1] + 0.6)
    ax.set_xlim(steps[0] - 0.6 - 0.02 * (steps[-1] - steps[0]),
                steps[-1] + 0.6 + 0.02 * (steps[-1] - steps[0]))
    for axis, values in ((ax.yaxis, ranks), (ax.xaxis, steps)):
        if len(values) <= 16:
            axis.set_ticks(values)
        else:
            axis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    return fig


def link_matrix(cells: list[tuple[int, int, int]]) -> Figure | None:
    """Corrupted chunks, senders down, receivers across (Summary.link_matrix)."""
    if not cells:
        return None
    srcs = sorted({c[0] for c in cells})
    dsts = sorted({c[1] for c in cells})
    grid = [[0] * len(dsts) for _ in srcs]
    for s, d, n in cells:
        grid[srcs.index(s)][dsts.index(d)] = n
    side = min(6.0, 1.6 + 0.45 * max(len(srcs), len(dsts)))
    fig = Figure(figsize=(side + 1.2, side))
    ax = fig.add_subplot()
    im = ax.imshow(grid, cmap="Reds", vmin=0, aspect="auto")
    if len(srcs) <= 32 and len(dsts) <= 32:
        ax.set_xticks(range(len(dsts)), [str(d) for d in dsts])
        ax.set_yticks(range(len(srcs)), [str(s) for s in srcs])
        top = max(n for _, _, n in cells)
        for i, row in enumerate(grid):
            for j, n in enumerate(row):
                if n:
                    ax.text(j, i, str(n), ha="center", va="center",
                            color="white" if n > top / 2 else "black")
    ax.set(xlabel="dst (received it)", ylabel="src (sent it)",
           title="corrupted chunks, src → dst")
    fig.colorbar(im, ax=ax, label="chunks")
    return fig


@dataclass
class OpRate:
    """Completed calls per op over time, counted as the records stream past: bins of
    ``width`` seconds (widened tenfold while more than _MAX_BINS would be kept)."""

    width: float = 0.01
    bins: Counter[tuple[str, int]] = field(default_factory=Counter)

    def add(self, c: Call) -> None:
        if c.entry:
            return
        self.bins[(c.op, int(c.t_enter // self.width))] += 1
        if len(self.bins) > _MAX_BINS:
            self.width *= 10
            old, self.bins = self.bins, Counter()
            for (op, b), n in old.items():
                self.bins[(op, int(b // 10))] += n

    def shown(self, most: int = 120) -> tuple[float, Counter[tuple[str, int]]]:
        """Bins widened by 1, 2 or 5 × 10^n to show at most ``most`` of them."""
        span = max(b for _, b in self.bins) - min(b for _, b in self.bins) + 1
        k = next(m * 10 ** e for e in range(16) for m in (1, 2, 5) if span <= most * m * 10 ** e)
        out: Counter[tuple[str, int]] = Counter()
        for (op, b), n in self.bins.items():
            out[(op, b // k)] += n
        return self.width * k, out

    def figure(self) -> Figure | None:
        if not self.bins:
            return None
        width, bins = self.shown()
        first = min(b for _, b in bins)
        last = max(b for _, b in bins)
        totals = Counter[str]()
        for (op, _), n in bins.items():
            totals[op] += n
        fig = Figure(figsize=(WIDTH, 3.2))
        ax = fig.add_subplot()
        xs = [(b - first) * width for b in range(first, last + 2)]
        for i, (op, _) in enumerate(totals.most_common(10)):
            ys = [bins.get((op, b), 0) / width for b in range(first, last + 1)]
            ys.append(ys[-1])
            ax.step(xs, ys, where="post", color=f"C{i}", label=op)
        ax.set(xlabel=f"seconds since the first call (bins of {width:g} s)",
               ylabel="calls / s (all ranks)", title="collectives per op over time")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
        return fig
