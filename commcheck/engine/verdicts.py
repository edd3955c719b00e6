"""Verdicts on one fully reported collective: pure functions from observations to findings.

Replicated outputs are decided by majority vote (DESIGN.md rule 5); pairwise chunk checks
name the corrupted link; reductions are checked against the float64 sums of their inputs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from ..wire import F_IN_HASH, F_IN_SUMMARY, F_INJECTED, F_OUT_HASH, F_OUT_SUMMARY, SIDE_IN, SIDE_OUT
from ..wire.ops import BY_NAME, Reduction
from .findings import (
    Divergence,
    Finding,
    Kind,
    LinkCorruption,
    NanInf,
    RankSum,
    ReductionError,
    Side,
    ValueMismatch,
)
from .model import Obs

# Unit roundoff per dtype; integers are exact up to float64's 53 bits.
_UNIT = {
    "float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
    "complex128": 2.0**-53, "complex64": 2.0**-24, "complex32": 2.0**-11,
}
_REDUCTION_CHECKED = {"SUM", "AVG"}


def _hex(h: tuple[int, int]) -> str:
    return f"{h[1]:016x}{h[0]:016x}"


def reduction_tolerance(dtype: str, world: int, numel: int, absmax_sum: float) -> float:
    """Bound on |float64 sum of inputs - float64 sum of output| for a correct reduction.

    Each output element may carry (world-1) roundings of the dtype; our block-wise summaries
    add a few more. The bound is loose on purpose: exact equality across ranks is the
    sharp check, this one catches reductions that are consistent but wrong.
    """
    unit = _UNIT.get(dtype, 2.0**-52)
    return (world + 20) * unit * max(numel, 1) * absmax_sum + 1e-30


def majority(groups: dict[object, list[int]]) -> tuple[object | None, list[list[int]]]:
    """The unique largest class (or None on a tie) and every class, largest first."""
    sides = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    if len(sides) > 1 and len(sides[0][1]) == len(sides[1][1]):
        return None, [r for _, r in sides]
    return sides[0][0], [r for _, r in sides]


class Verdicts:
    def __init__(self, run: str, group: str, seq: int, obs: dict[int, Obs]):
        self.run, self.group, self.seq, self.obs = run, group, seq, obs
        self.first = obs[min(obs)]
        self.spec = BY_NAME.get(self.first.op)

    def finding(self, kind: Kind, culprits: Iterable[int],
                detail: ValueMismatch | LinkCorruption | ReductionError | NanInf,
                ambiguous: bool = False) -> Finding:
        culprits = sorted(culprits)
        who = [self.obs[r] for r in culprits] or list(self.obs.values())
        hosts = sorted({o.host for o in who})
        site = who[0].callsite
        if any(o.flags & F_INJECTED for o in self.obs.values()):
            detail.injected = True
        return Finding(kind=kind, run=self.run, op=self.first.op, group=self.group,
                       seq=self.seq, step=min(o.step for o in self.obs.values()),
                       culprits=culprits, hosts=hosts, callsite=site, detail=detail,
                       ambiguous=ambiguous, t=max(o.t_done for o in self.obs.values()))

    def decide(self) -> list[Finding]:
        if self.spec is None:
            return []
        out = self.link_corruption()
        explained = {r for f in out for r in f.culprits}
        if self.spec.replicated:
            out.extend(self.value_mismatch(explained))
        if self.spec.reduction is not Reduction.NONE and not out:
            out.extend(self.reduction_error())
        return out

    def _with_output(self) -> list[Obs]:
        algos = {o.algo for o in self.obs.values()}
        if len(algos) != 1:
            return []  # only compare like with like (DESIGN.md rule 3)
        return [o for o in self.obs.values() if o.flags & F_OUT_HASH]

    def value_mismatch(self, explained: set[int]) -> list[Finding]:
        by_hash: dict[tuple[int, int], list[int]] = defaultdict(list)
        for o in self._with_output():
            by_hash[o.out_hash].append(o.rank)
        if len(by_hash) < 2:
            return []
        winner, sides = majority(by_hash)
        summarized = all(o.flags & F_OUT_SUMMARY for o in self.obs.values())
        detail_sides = []
        for ranks in sides:
            o = self.obs[ranks[0]]
            side = Side(ranks=sorted(ranks), hash=_hex(o.out_hash))
            if summarized:
                side.sum, side.absmax = o.out_sum, o.out_absmax
            detail_sides.append(side)
        kind = Kind(self.spec.mismatch_kind)
        detail = ValueMismatch(sides=detail_sides) if kind is Kind.VALUE_MISMATCH else \
            Divergence(sides=detail_sides, later_steps=0)
        if winner is None:
            return [self.finding(kind, [r for s in sides for r in s], detail, ambiguous=True)]
        culprits = [r for s in sides[1:] for r in s]
        if set(culprits) <= explained:
            return []
        if summarized:
            ref = self.obs[by_hash[winner][0]]
            diffs = [abs(self.obs[r].out_sum - ref.out_sum) for r in culprits]
            detail.sum_abs_diff = max(diffs)
            detail.sum_rel_diff = max(diffs) / max(abs(ref.out_sum), 1e-300)
        return [self.finding(kind, culprits, detail)]

    def _sent(self, src: int, dst: int) -> tuple[int, int] | None:
        """What ``src`` says it sent to ``dst``: its input chunk for dst, or its whole input."""
        o = self.obs.get(src)
        if o is None or not o.flags & F_IN_HASH:
            return None
        chunks = [(h0, h1) for side, owner, h0, h1, _ in o.chunks if side == SIDE_IN]
        if not chunks:
            return o.in_hash
        for side, owner, h0, h1, _ in o.chunks:
            if side == SIDE_IN and owner == dst:
                return h0, h1
        return None

    def link_corruption(self) -> list[Finding]:
        """Output chunk from j on rank i must hash like what rank j sent to i."""
        if len({o.algo for o in self.obs.values()}) != 1:
            return []
        found = []
        for o in self.obs.values():
            if not o.flags & F_OUT_HASH:
                continue
            bad = []
            for side, src, h0, h1, _ in o.chunks:
                if side == SIDE_OUT:
                    sent = self._sent(src, o.rank)
                    if sent is not None and sent != (h0, h1):
                        bad.append((src, o.rank))
            if bad:
                found.append(self.finding(Kind.LINK_CORRUPTION, [o.rank],
                                          LinkCorruption(links=bad)))
        return found

    def reduction_error(self) -> list[Finding]:
        obs = list(self.obs.values())
        if (self.first.redop not in _REDUCTION_CHECKED
                or any(not o.flags & F_IN_SUMMARY for o in obs)
                or any(not o.flags & F_OUT_SUMMARY for o in obs if
                       self.spec.reduction is not Reduction.ROOT or o.rank == o.root)
                or any(o.in_nan or o.in_inf for o in obs)
                or len({o.algo for o in obs}) != 1):
            return []
        world = len(obs)
        scale = 1.0 / world if self.first.redop == "AVG" else 1.0
        absmax_sum = sum(o.in_absmax for o in obs)
        kind = self.spec.reduction
        if kind is Reduction.SCATTER:  # rank i's output: everyone's input chunk for i
            expected = {o.rank: 0.0 for o in obs}
            for p in obs:
                for side, owner, _, _, s in p.chunks:
                    if side == SIDE_IN and owner in expected:
                        expected[owner] += s * scale
        else:
            total = sum(p.in_sum for p in obs) * scale
            expected = {o.rank: total for o in obs
                        if kind is Reduction.ALL or o.rank == o.root}
        numel = {o.rank: o.numel_out for o in obs}
        bad, worst = [], {}
        for o in (o for o in obs if o.rank in expected):
            tol = reduction_tolerance(o.dtype, world, numel[o.rank], absmax_sum)
            err = abs(o.out_sum - expected[o.rank])
            if not math.isfinite(o.out_sum) or err > tol:
                bad.append(o.rank)
                worst[str(o.rank)] = RankSum(expected_sum=expected[o.rank],
                                             output_sum=o.out_sum, abs_err=err, tolerance=tol)
        if not bad:
            return []
        if kind is Reduction.ALL and len(bad) == world:
            # Consistent everywhere but wrong: no vote can single out a rank.
            return [self.finding(Kind.REDUCTION_ERROR, [], ReductionError(ranks=worst),
                                 ambiguous=True)]
        return [self.finding(Kind.REDUCTION_ERROR, bad, ReductionError(ranks=worst))]
