"""A trace written by `commcheck trace` drawn as a timeline PNG with matplotlib, for the docs
(docs/trace.png): Perfetto's UI is a web app fetched from ui.perfetto.dev and this
distribution's Chromium no longer ships chrome://tracing, so neither can render offline
here. Same reading as the viewers: a track per rank under its host, a bar per slice
coloured by op, a red mark per finding (instant event) with its text, open slices (begin
events never ended) hatched to the end of the trace.

    python launch/tools/trace_timeline.py runs/demo-trace.json docs/trace.png [--from S --to S]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--from", dest="lo", type=float, default=None,
                    help="seconds since the first event")
    ap.add_argument("--to", dest="hi", type=float, default=None)
    a = ap.parse_args()
    events = json.loads(Path(a.trace).read_text())["traceEvents"]
    hosts = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = sorted({(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"})
    row = {t: i for i, t in enumerate(tracks)}
    timed = [e for e in events if e["ph"] in ("X", "B", "i")]
    t0 = min(e["ts"] for e in timed)
    end = max(e["ts"] + e.get("dur", 0) for e in timed)
    ops = sorted({e["name"] for e in timed if e["ph"] == "X"})
    color = {op: f"C{i % 10}" for i, op in enumerate(ops)}
    fig = Figure(figsize=(13, 1.2 + 0.55 * len(tracks)))
    ax = fig.add_subplot()
    s = lambda us: (us - t0) / 1e6  # noqa: E731
    marks = 0
    for e in timed:
        y = row.get((e["pid"], e["tid"]))
        if y is None:
            continue
        if e["ph"] == "X":
            ax.broken_barh([(s(e["ts"]), max(e["dur"] / 1e6, 1e-4))], (y - 0.35, 0.7),
                           color=color[e["name"]], linewidth=0)
        elif e["ph"] == "B":
            ax.broken_barh([(s(e["ts"]), s(end) - s(e["ts"]))], (y - 0.35, 0.7),
                           facecolor="none", edgecolor="black", hatch="///")
        else:
            marks += 1
            ax.plot([s(e["ts"])] * 2, [y - 0.45, y + 0.45], color="red", linewidth=2)
            ax.annotate(e["name"], (s(e["ts"]), y - 0.45), fontsize=8, color="red",
                        xytext=(4, -12 * marks), textcoords="offset points",
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    ax.set_yticks(range(len(tracks)),
                  [f"{hosts.get(pid, pid)} · rank {tid}" for pid, tid in tracks])
    ax.invert_yaxis()
    ax.set_xlim(a.lo if a.lo is not None else 0, a.hi if a.hi is not None else s(end))
    ax.set_xlabel("seconds since the first event (each rank's own clock)")
    ax.set_title(f"{Path(a.trace).name}: {sum(e['ph'] == 'X' for e in timed)} slices, "
                 f"{sum(e['ph'] == 'i' for e in timed)} findings (matplotlib rendering of "
                 f"the trace file)", fontsize=10)
    handles = [Patch(color=c, label=op) for op, c in color.items()]
    handles.append(Patch(color="red", label="finding (instant event)"))
    if any(e["ph"] == "B" for e in timed):
        handles.append(Patch(facecolor="none", edgecolor="black", hatch="///",
                             label="never completed (open)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18),
              ncol=len(handles), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(a.png, dpi=110, bbox_inches="tight")
    print(f"{a.png}: {len(tracks)} tracks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
