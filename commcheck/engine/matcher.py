"""Matching records across ranks by (run, group identity, sequence) and deciding when complete.

The engine is fed decoded columnar batches; it keeps, per open key, one :class:`Obs` per
rank that reported so far, and runs :class:`Verdicts` the moment every member of the group
has reported. Memory is bounded by the open window, not by the run's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..wire import GOODBYE, HELLO, RECORDS, Batch
from .model import Finding, Key, Obs, group_label
from .verdicts import Verdicts


@dataclass
class RankState:
    host: str
    node: int = -1
    hello: bool = False
    goodbye: bool = False
    records: int = 0
    last_t: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineStats:
    records: int = 0
    verified: int = 0
    findings: int = 0
    open_keys: int = 0
    world: int = 0


class Engine:
    def __init__(self, world_size: int = 0):
        self.world_size = world_size
        self.ranks: dict[int, RankState] = {}
        self.open: dict[Key, dict[int, Obs]] = {}
        self.stats = EngineStats(world=world_size)
        self.runs: set[str] = set()

    @property
    def done(self) -> bool:
        """Every expected rank said goodbye."""
        n = self.world_size or max((r + 1 for r in self.ranks), default=0)
        return n > 0 and sum(s.goodbye for s in self.ranks.values()) >= n

    def ingest(self, batch: Batch) -> list[Finding]:
        env = batch.env
        state = self.ranks.get(env.rank)
        if state is None:
            state = self.ranks[env.rank] = RankState(env.host, env.node)
        state.host, state.last_t = env.host, max(state.last_t, env.t)
        if env.counters:
            state.counters.update(env.counters)
        if env.world and not self.world_size:
            self.world_size = self.stats.world = env.world
        self.runs.add(env.run)
        if env.kind == HELLO:
            state.hello = True
        elif env.kind == GOODBYE:
            state.goodbye = True
        if env.kind != RECORDS or not len(batch.records):
            return []
        state.records += len(batch.records)
        self.stats.records += len(batch.records)
        return self._match(batch)

    def _match(self, batch: Batch) -> list[Finding]:
        env, rec = batch.env, batch.records
        s = env.strings
        groups = [(name, tuple(ranks)) for name, ranks in env.groups]
        cols = {name: rec[name].tolist() for name in rec.dtype.names}
        chunks = batch.chunks.tolist()
        findings: list[Finding] = []
        for i in range(len(rec)):
            gname, granks = groups[cols["group"][i]]
            key: Key = (env.run, gname, granks, cols["seq"][i])
            off, n = cols["chunk_off"][i], cols["chunk_n"][i]
            obs = Obs(
                env.rank, env.host, s[cols["op"][i]], s[cols["dtype"][i]], s[cols["redop"][i]],
                cols["root"][i], s[cols["algo"][i]], s[cols["callsite"][i]], cols["flags"][i],
                cols["numel_in"][i], cols["numel_out"][i], cols["step"][i], cols["t_done"][i],
                (cols["in_h0"][i], cols["in_h1"][i]), (cols["out_h0"][i], cols["out_h1"][i]),
                cols["in_sum"][i], cols["in_absmax"][i], cols["in_nan"][i], cols["in_inf"][i],
                cols["out_sum"][i], cols["out_absmax"][i], cols["out_nan"][i],
                cols["out_inf"][i], tuple(chunks[off:off + n]),
            )
            entry = self.open.setdefault(key, {})
            entry[env.rank] = obs
            if len(entry) == len(granks):
                del self.open[key]
                findings.extend(self._decide(key, entry))
        self.stats.open_keys = len(self.open)
        return findings

    def _decide(self, key: Key, obs: dict[int, Obs]) -> list[Finding]:
        run, gname, granks, seq = key
        self.stats.verified += 1
        found = Verdicts(run, group_label(gname, granks), seq, obs).decide()
        self.stats.findings += len(found)
        return found

    def unmatched(self) -> int:
        """Collectives some members never reported (dropped records or ranks that died)."""
        return len(self.open)
