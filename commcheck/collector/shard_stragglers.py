"""The shards' straggler findings as one engine's: one finding per rank (or link) and episode.

With ``collect --shards K`` each shard judges the windows of its own groups, so a rank slow
in groups on two shards is found by both. One engine raises one finding for it, naming
every group that found it (stragglers.py); the router does the same here: the first
shard's finding is stored, another shard's finding of the same rank (or host pair, or node)
whose steps overlap that episode's joins it (its groups, its cost), and the episode ends
when every shard's part of it ended. Steps, not arrival at the router: shards work through
their queues at their own pace, so one may report an episode whole before another starts
on it. Findings are updated from the shards' latest details (their
``onsets``). Not kept across a restart of the collector: after one, a shard's update of a
part joined before it changes nothing stored (docs/ingest.md).
"""

from __future__ import annotations

import copy

from ..engine import Finding

_Part = tuple[int, str, str, int, tuple[int, ...]]  # shard, run, group, seq, culprits
KEPT_EPISODES = 16  # per rank (or link): the latest, which a shard's finding may join
MAX_PARTS = 8192  # parts remembered (each shard resends its latest 1,024 raised findings)


def _who(f: Finding) -> tuple:
    d = f.detail
    return (f.run, d.cause, d.rank, tuple(d.link))


def _part(shard: int, f: Finding) -> _Part:
    return (shard, f.run, f.group, f.seq, tuple(f.culprits))


class _Merged:
    """One episode as stored: the first part's finding, its details joined over the parts."""

    def __init__(self, finding: Finding):
        self.finding = copy.deepcopy(finding)
        self.parts: dict[_Part, Finding] = {}

    def join(self) -> Finding:
        d, parts = self.finding.detail, list(self.parts.values())
        d.groups = sorted({g for p in parts for g in p.detail.groups})
        cost = sum(p.detail.cost_s for p in parts)
        others = sum(p.detail.cost_s * 100 / p.detail.cost_pct for p in parts
                     if p.detail.cost_pct > 0)
        d.cost_s = round(cost, 6)
        d.cost_pct = round(100 * cost / others, 2) if others > 0 else 0.0
        ended = [p.detail for p in parts if p.detail.ended]
        d.ended = len(ended) == len(parts)
        d.end_step = max(e.end_step for e in ended) if d.ended else None
        d.end_t = max(e.end_t for e in ended) if d.ended else None
        return self.finding


class ShardStragglers:
    """New straggler findings and their updates, from any shard, in; what to store out."""

    def __init__(self) -> None:
        self.episodes: dict[tuple, list[_Merged]] = {}  # who -> its latest episodes
        self.of_part: dict[_Part, _Merged] = {}

    def new(self, shard: int, f: Finding) -> Finding | None:
        """A shard's new finding: to store (a new episode), or None (joined another)."""
        mine = self.episodes.setdefault(_who(f), [])
        merged = next((m for m in mine if _overlap(m.finding, f)), None)
        fresh = merged is None
        if merged is None:
            merged = _Merged(f)
            mine.append(merged)
            del mine[:-KEPT_EPISODES]
        merged.parts[_part(shard, f)] = f
        self.of_part[_part(shard, f)] = merged
        if len(self.of_part) > MAX_PARTS:
            del self.of_part[next(iter(self.of_part))]
        out = merged.join()
        return out if fresh else None

    def update(self, shard: int, f: Finding) -> Finding:
        """A shard's latest detail of a finding it raised: the stored finding to update."""
        merged = self.of_part.get(_part(shard, f))
        if merged is None:  # raised before a restart of the collector
            return f
        merged.parts[_part(shard, f)] = f
        return merged.join()


def _overlap(a: Finding, b: Finding) -> bool:
    """The two episodes' steps overlap (one still on: up to now)."""
    a_end = a.detail.end_step if a.detail.ended else None
    b_end = b.detail.end_step if b.detail.ended else None
    return (a_end is None or b.detail.start_step <= a_end) and \
        (b_end is None or a.detail.start_step <= b_end)
