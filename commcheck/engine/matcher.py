"""Matching records across ranks by (run, group identity, sequence) and deciding.

Per open key the engine keeps what each member said when it entered the call (:class:`Meta`,
from entry records or, failing those, complete records) and what it reported at completion
(:class:`Obs`). Desync is decided once every member entered; values once every member
completed; hangs by :meth:`Engine.check_hangs`, which the collector calls periodically with
the current time. Memory is bounded by the open window, not by the run's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..wire import GOODBYE, HELLO, PHASE_ENTRY, RECORDS, Batch
from .desync import desync
from .model import Finding, Key, Meta, Obs, group_label
from .verdicts import Verdicts

DEFAULT_HANG_TIMEOUT = 30.0


@dataclass
class RankState:
    host: str
    node: int = -1
    hello: bool = False
    goodbye: bool = False
    records: int = 0
    last_t: float = 0.0
    last: tuple[str, Meta] | None = None  # (group label, seq) and metadata of the last entry
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class OpenKey:
    entered: dict[int, Meta] = field(default_factory=dict)
    complete: dict[int, Obs] = field(default_factory=dict)
    desync_checked: bool = False
    desynced: bool = False
    hang_reported: bool = False


@dataclass
class EngineStats:
    records: int = 0
    verified: int = 0
    findings: int = 0
    open_keys: int = 0
    world: int = 0
    nan_folded: int = 0


@dataclass
class NanOnset:
    """The first collective of a group whose inputs carried NaN/Inf; later ones fold in."""

    finding: Finding
    folded: int = 0


class Engine:
    def __init__(self, world_size: int = 0, hang_timeout: float = DEFAULT_HANG_TIMEOUT):
        self.world_size = world_size
        self.hang_timeout = hang_timeout
        self.ranks: dict[int, RankState] = {}
        self.open: dict[Key, OpenKey] = {}
        self.stats = EngineStats(world=world_size)
        self.runs: set[str] = set()
        self.nan_onsets: dict[tuple[str, str, tuple[int, ...]], NanOnset] = {}

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
        return self._match(batch, state)

    def _match(self, batch: Batch, state: RankState) -> list[Finding]:
        env, rec = batch.env, batch.records
        s = env.strings
        groups = [(name, tuple(ranks)) for name, ranks in env.groups]
        cols = {name: rec[name].tolist() for name in rec.dtype.names}
        chunks = batch.chunks.tolist()
        shapes = batch.shapes.tolist()
        findings: list[Finding] = []
        for i in range(len(rec)):
            gname, granks = groups[cols["group"][i]]
            key: Key = (env.run, gname, granks, cols["seq"][i])
            o1 = cols["shape_off"][i]
            o2 = o1 + cols["in_ndim"][i]
            o3 = o2 + cols["out_ndim"][i]
            o4 = o3 + cols["in_splits_n"][i]
            in_shape, out_shape = tuple(shapes[o1:o2]), tuple(shapes[o2:o3])
            in_splits, out_splits = tuple(shapes[o3:o4]), \
                tuple(shapes[o4:o4 + cols["out_splits_n"][i]])
            meta = Meta(env.rank, env.host, s[cols["op"][i]], s[cols["dtype"][i]],
                        cols["numel_in"][i], cols["numel_out"][i], in_shape, out_shape,
                        s[cols["redop"][i]], cols["root"][i], cols["peer"][i], in_splits,
                        out_splits, s[cols["callsite"][i]], cols["step"][i],
                        cols["t_enter"][i])
            ok = self.open.get(key)
            if ok is None:
                ok = self.open[key] = OpenKey()
            if env.rank not in ok.entered:
                ok.entered[env.rank] = meta
                if state.last is None or meta.t_enter >= state.last[1].t_enter:
                    state.last = (f"{group_label(gname, granks)} seq {key[3]}", meta)
            if not ok.desync_checked and len(ok.entered) == len(granks):
                ok.desync_checked = True
                found = desync(env.run, group_label(gname, granks), key[3], ok.entered)
                ok.desynced = bool(found)
                findings.extend(found)
            if cols["phase"][i] == PHASE_ENTRY:
                continue
            off, n = cols["chunk_off"][i], cols["chunk_n"][i]
            ok.complete[env.rank] = Obs(
                env.rank, env.host, meta.op, meta.dtype, meta.redop, meta.root,
                s[cols["algo"][i]], meta.callsite, cols["flags"][i], meta.numel_in,
                meta.numel_out, meta.step, cols["t_done"][i],
                (cols["in_h0"][i], cols["in_h1"][i]), (cols["out_h0"][i], cols["out_h1"][i]),
                cols["in_sum"][i], cols["in_absmax"][i], cols["in_nan"][i], cols["in_inf"][i],
                cols["out_sum"][i], cols["out_absmax"][i], cols["out_nan"][i],
                cols["out_inf"][i], tuple(chunks[off:off + n]),
            )
            if len(ok.complete) == len(granks):
                del self.open[key]
                if not ok.desynced:
                    findings.extend(self._decide(key, ok.complete))
        self.stats.open_keys = len(self.open)
        self.stats.findings += len(findings)
        return findings

    def _decide(self, key: Key, obs: dict[int, Obs]) -> list[Finding]:
        run, gname, granks, seq = key
        self.stats.verified += 1
        label = group_label(gname, granks)
        verdicts = Verdicts(run, label, seq, obs)
        if not any(o.in_nan or o.in_inf or o.out_nan or o.out_inf for o in obs.values()):
            return verdicts.decide()
        onset = self.nan_onsets.get((run, gname, granks))
        if onset is not None:  # a consequence of the first NaN: count it, do not repeat it
            onset.folded += 1
            onset.finding.detail["later_collectives_with_nan_inf"] = onset.folded
            self.stats.nan_folded += 1
            return []
        senders = sorted(r for r, o in obs.items() if o.in_nan or o.in_inf)
        if not senders:  # NaN appeared in outputs only: a comparison problem, not an onset
            return verdicts.decide()
        f = verdicts.finding("nan_inf", senders, {
            "inputs": {str(r): {"nan": obs[r].in_nan, "inf": obs[r].in_inf} for r in senders},
            "later_collectives_with_nan_inf": 0,
        })
        self.nan_onsets[(run, gname, granks)] = NanOnset(f)
        return [f]

    def check_hangs(self, now: float, final: bool = False) -> list[Finding]:
        """``missing_rank`` for collectives some members entered ``hang_timeout`` s ago
        while others never did; at the end of a run (``final``) regardless of time."""
        found = []
        for (run, gname, granks, seq), ok in self.open.items():
            if ok.hang_reported or not ok.entered:
                continue
            missing = [r for r in granks if r not in ok.entered]
            if not missing:
                continue
            since = min(m.t_enter for m in ok.entered.values())
            if not final and now - since < self.hang_timeout:
                continue
            ok.hang_reported = True
            found.append(self._missing(run, group_label(gname, granks), seq, ok, missing,
                                       now, since))
        self.stats.findings += len(found)
        return found

    def _missing(self, run: str, label: str, seq: int, ok: OpenKey, missing: list[int],
                 now: float, since: float) -> Finding:
        last = {}
        for r in missing:
            state = self.ranks.get(r)
            if state is None or state.last is None:
                last[str(r)] = None
                continue
            where, m = state.last
            last[str(r)] = {"op": m.op, "at": where, "callsite": m.callsite,
                            "ago_s": round(now - m.t_enter, 3) if math.isfinite(now) else None,
                            "said_goodbye": state.goodbye}
        waiting = sorted(ok.entered)
        any_meta = ok.entered[waiting[0]]
        return Finding(
            kind="missing_rank", run=run, op=any_meta.op, group=label, seq=seq,
            step=min(m.step for m in ok.entered.values()), culprits=missing,
            hosts=sorted({self.ranks[r].host for r in missing if r in self.ranks}),
            callsite=any_meta.callsite,
            detail={"waiting": waiting, "waited_s": round(now - since, 3)
                    if math.isfinite(now) else None, "last": last},
            t=since)

    def finish(self) -> list[Finding]:
        """End of the run: collectives still missing members are reported as hangs."""
        return self.check_hangs(math.inf, final=True)

    def unmatched(self) -> int:
        """Collectives some members never reported (dropped records or ranks that died)."""
        return len(self.open)
