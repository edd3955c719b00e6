"""Who made the others wait: the per-rank and per-host lateness the report, the live view and
the metrics show, read from the engine's ``late.<rank>.<field>`` counters (lateness.py;
they add up across shards). See docs/stragglers.md."""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table
from rich.text import Text

from ..engine.findings import RankLateness
from ..engine.lateness import GAP_BINS, GAP_FLOOR
from ..engine.stragglers import rank_rows

SHOWN = 16  # rows of the report's tables (most costly first)


def _median_gap_ms(bins: list[int]) -> float:
    """The time-weighted median of a log2 histogram of gaps (``lateness.GAP_FLOOR``, each
    bin at its geometric middle): half the rank's lateness came in gaps at least this long.
    By count, a rank slow to compute would read as punctual: it is late to the first
    collective of a step only, and last by chance in the lockstep rest. 0 when empty."""
    mid = [0.0] + [GAP_FLOOR * 2 ** (b - 0.5) for b in range(1, len(bins))]
    weight = [n * m for n, m in zip(bins, mid, strict=True)]
    total, seen = sum(weight), 0.0
    for b, w in enumerate(weight):
        seen += w
        if total and 2 * seen >= total:
            return round(1e3 * mid[b], 3)
    return 0.0


def _bins(fields: Mapping[str, int]) -> list[int]:
    return [fields.get(f"gap{b}", 0) for b in range(GAP_BINS)]


def _row(host: str, calls: int, last: int, bins: list[int], wait_us: int, cost_us: int,
         rank: int | None = None, ranks: list[int] | None = None) -> RankLateness:
    return RankLateness(rank=rank, host=host, ranks=ranks or [], collectives=calls, last=last,
                        last_pct=round(100 * last / calls, 1) if calls else 0.0,
                        median_gap_ms=_median_gap_ms(bins), wait_s=round(wait_us / 1e6, 3),
                        cost_s=round(cost_us / 1e6, 3))


def lateness_rows(counters: Mapping[str, int], hosts: Mapping[int, str]) -> list[RankLateness]:
    """One row per rank that took part in a completed collective, most costly first."""
    out = [_row(hosts.get(r, ""), f.get("calls", 0), f.get("last", 0), _bins(f),
                f.get("wait_us", 0), f.get("cost_us", 0), rank=r)
           for r, f in rank_rows(counters).items()]
    return sorted(out, key=lambda x: (-x.cost_s, x.rank))


def by_host_rows(rows: list[RankLateness], counters: Mapping[str, int]) -> list[RankLateness]:
    """The rank rows summed per host (its gaps' histograms merged), most costly first."""
    fields = rank_rows(counters)
    hosts: dict[str, list[RankLateness]] = {}
    for r in rows:
        hosts.setdefault(r.host, []).append(r)
    out = []
    for host, rs in hosts.items():
        bins = [sum(x) for x in zip(*(_bins(fields[r.rank]) for r in rs), strict=True)]
        out.append(_row(host, sum(r.collectives for r in rs), sum(r.last for r in rs), bins,
                        sum(fields[r.rank].get("wait_us", 0) for r in rs),
                        sum(fields[r.rank].get("cost_us", 0) for r in rs),
                        ranks=sorted(r.rank for r in rs)))
    return sorted(out, key=lambda x: (-x.cost_s, x.host))


def table(rows: list[RankLateness], per_host: bool = False) -> Table:
    """The report's table: share of collectives last, median gap when last, time cost."""
    t = Table(title="lateness per host" if per_host else "lateness per rank (who the others "
                                                         "waited for)")
    for col in ("host", "ranks") if per_host else ("rank", "host"):
        t.add_column(col)
    for col in ("collectives", "last", "median lateness (by time)", "own wait",
                "cost to others"):
        t.add_column(col, justify="right")
    for r in rows[:SHOWN]:
        who = (r.host, ",".join(map(str, r.ranks))) if per_host else (str(r.rank), r.host)
        t.add_row(*(Text(w) for w in who), str(r.collectives), f"{r.last_pct:g} %",
                  f"{r.median_gap_ms:g} ms", f"{r.wait_s:g} s", f"{r.cost_s:g} s")
    if len(rows) > SHOWN:
        t.caption = f"... and {len(rows) - SHOWN} more"
    return t


def live_line(counters: Mapping[str, int], hosts: Mapping[int, str]) -> str:
    """The live view's lateness: the ranks that cost the others most, up to three."""
    rows = [r for r in lateness_rows(counters, hosts) if r.last][:3]
    return "; ".join(f"rank {r.rank} ({r.host}) last {r.last_pct:g} %, "
                     f"{r.median_gap_ms:g} ms behind, cost {r.cost_s:g} s" for r in rows)
