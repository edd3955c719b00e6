"""Verdicts on one fully reported collective: pure functions from observations to findings.

Replicated outputs are decided by majority vote (DESIGN.md rule 5); pairwise chunk checks
name the corrupted link; reductions are checked against the float64 sums of their inputs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from ..wire import F_IN_HASH, F_IN_SUMMARY, F_INJECTED, F_OUT_HASH, F_OUT_SUMMARY, SIDE_IN, SIDE_OUT
from ..wire.ops import BY_NAME, HOOK_REDOPS, Reduction, Split
from .findings import (
    Divergence,
    Finding,
    Kind,
    LinkCorruption,
    NanInf,
    RankSum,
    ReductionError,
    Side,
    TieBreak,
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


# float16's smallest subnormal: what a gradient below it loses when a hook compresses it
_FP16_TINY = 2.0**-24


def compressed_tolerance(dtype: str, world: int, numel: int, absmax_sum: float) -> float:
    """:func:`reduction_tolerance` for a reduction that went through ``dtype`` (a comm hook's
    fp16/bf16 compression): its rounding, and for float16 what flushes to zero or
    subnormals (bfloat16 keeps float32's exponent range)."""
    tol = reduction_tolerance(dtype, world, numel, absmax_sum)
    if dtype == "float16":
        tol += world * max(numel, 1) * _FP16_TINY
    return tol


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
        op = who[0].op  # the culprit's side: a corrupted receive is the recv's finding
        return Finding(kind=kind, run=self.run, op=op, group=self.group,
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
        """Replicated outputs that differ. Ranks in ``explained`` (receivers of a corrupted
        chunk in this collective) do not vote: their output differs for a known reason. A
        tie goes to the evidence (:meth:`break_tie`)."""
        by_hash: dict[tuple[int, int], list[int]] = defaultdict(list)
        for o in self._with_output():
            if o.rank not in explained:
                by_hash[o.out_hash].append(o.rank)
        if len(by_hash) < 2:
            return []
        winner, sides = majority(by_hash)
        tie = None
        if winner is None:
            tie, right = self.break_tie(sides)
            if right is not None:
                sides = [right] + [s for s in sides if s is not right]
                winner = self.obs[right[0]].out_hash
        summarized = all(o.flags & F_OUT_SUMMARY for o in self.obs.values())
        detail_sides = []
        for ranks in sides:
            o = self.obs[ranks[0]]
            side = Side(ranks=sorted(ranks), hash=_hex(o.out_hash))
            if summarized:
                side.sum, side.absmax = o.out_sum, o.out_absmax
            detail_sides.append(side)
        kind = Kind(self.spec.mismatch_kind)
        detail = ValueMismatch(sides=detail_sides, tie=tie) if kind is Kind.VALUE_MISMATCH \
            else Divergence(sides=detail_sides, tie=tie, later_steps=0)
        if winner is None:
            return [self.finding(kind, [r for s in sides for r in s], detail, ambiguous=True)]
        culprits = [r for s in sides[1:] for r in s]
        if summarized:
            ref = self.obs[by_hash[winner][0]]
            diffs = [abs(self.obs[r].out_sum - ref.out_sum) for r in culprits]
            detail.sum_abs_diff = max(diffs)
            detail.sum_rel_diff = max(diffs) / max(abs(ref.out_sum), 1e-300)
        return [self.finding(kind, culprits, detail)]

    def break_tie(self, sides: list[list[int]]) -> tuple[TieBreak, list[int] | None]:
        """Sides of equal size: which one do the records say is right? Reductions: the
        one side whose output sums to the reduction of the inputs; broadcast: the one side
        whose output hashes like the root's input. Returns the tie's account and the right
        side, or None (ambiguous, the account says why)."""
        if self.spec.reduction is Reduction.ALL or self._hook_mean():
            return self._tie_by_reduction(sides)
        if self.spec.input_on_root_only:
            return self._tie_by_root(sides)
        return TieBreak(by="", decided=False, evidence=(
            "no record says which output is right: the chunks each rank received hash "
            "like what their owners sent" if self.spec.output_split is not Split.NONE else
            "no record says which output is right")), None

    def _hook_mean(self) -> bool:
        """A bucket every member reduced with one of torch's averaging hooks, its sums
        recorded (``HOOK_REDOPS``): its inputs can settle a tie as a reduction's do."""
        return self.spec.reduction is Reduction.NONE and self.first.redop in HOOK_REDOPS and \
            all(o.redop == self.first.redop for o in self.obs.values())

    def _tie_by_reduction(self, sides: list[list[int]]) -> tuple[TieBreak, list[int] | None]:
        sums, why = self._reduction_sums()
        if why:
            return TieBreak(by="reduction", decided=False,
                            evidence=f"the reduction cannot be checked: {why}"), None
        checks = {str(s[0]): sums[s[0]] for s in sides}
        ok = [s for s in sides if _within(sums[s[0]])]
        expected = sums[sides[0][0]].expected_sum
        if len(ok) == 1:
            bad = [s for s in sides if s is not ok[0]]
            said = "; ".join(f"{_who(s)} output sum {sums[s[0]].output_sum:.3g}" for s in bad)
            good = sums[ok[0][0]]
            evidence = (f"{said}, inputs reduce to {expected:.3g}; {_who(ok[0])} output "
                        f"sum {good.output_sum:.3g} is within the tolerance "
                        f"{good.tolerance:.2g}")
            return TieBreak(by="reduction", decided=True, evidence=evidence,
                            ranks=checks), ok[0]
        if ok:
            outs = [s.output_sum for s in checks.values()]
            diff = max(outs) - min(outs)
            evidence = (f"every side's output sum is within the tolerance "
                        f"{sums[sides[0][0]].tolerance:.2g} of the inputs' reduction "
                        f"{expected:.3g} (they differ by {diff:.2g}): a change this small "
                        f"cannot be told from rounding")
        else:
            evidence = (f"no side's output sum is within tolerance of the inputs' "
                        f"reduction {expected:.3g}")
        return TieBreak(by="reduction", decided=False, evidence=evidence, ranks=checks), None

    def _tie_by_root(self, sides: list[list[int]]) -> tuple[TieBreak, list[int] | None]:
        root = self.obs.get(self.first.root)
        if root is None or not root.flags & F_IN_HASH:
            return TieBreak(by="root_input", decided=False, evidence=(
                f"root rank {self.first.root} recorded no hash of its input")), None
        match = [s for s in sides if self.obs[s[0]].out_hash == root.in_hash]
        if len(match) != 1:
            return TieBreak(by="root_input", decided=False, evidence=(
                f"no output hashes like root rank {root.rank}'s input")), None
        bad = [r for s in sides if s is not match[0] for r in s]
        return TieBreak(by="root_input", decided=True, evidence=(
            f"{_who(match[0])} output hashes like root rank {root.rank}'s input, "
            f"{_who(bad)} output does not")), match[0]

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

    def _reduction_sums(self) -> tuple[dict[int, RankSum], str]:
        """Each checked rank's output sum against the float64 reduction of the inputs
        (reduction_tolerance); or why the records cannot say (the second item, else "")."""
        obs = list(self.obs.values())
        kind = Reduction.ALL if self._hook_mean() else self.spec.reduction
        compressed = HOOK_REDOPS.get(self.first.redop)
        if self.first.redop not in _REDUCTION_CHECKED and not self._hook_mean():
            return {}, f"reduce op {self.first.redop or '?'} is not checked (SUM and AVG are)"
        if any(not o.flags & F_IN_SUMMARY for o in obs):
            return {}, "some rank recorded no input sum"
        if any(not o.flags & F_OUT_SUMMARY for o in obs
               if kind is not Reduction.ROOT or o.rank == o.root):
            return {}, "some rank recorded no output sum"
        if any(o.in_nan or o.in_inf for o in obs):
            return {}, "inputs carry NaN or Inf"
        if len({o.algo for o in obs}) != 1:
            return {}, "ranks summarised with different algorithms"
        world = len(obs)
        scale = 1.0 / world if self.first.redop.startswith("AVG") else 1.0
        absmax_sum = sum(o.in_absmax for o in obs)
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
        out = {}
        for o in (o for o in obs if o.rank in expected):
            tol = reduction_tolerance(o.dtype, world, o.numel_out, absmax_sum)
            if compressed is not None:  # rounded to the hook's dtype on the way
                tol = max(tol, compressed_tolerance(compressed, world, o.numel_out,
                                                    absmax_sum))
            out[o.rank] = RankSum(expected_sum=expected[o.rank], output_sum=o.out_sum,
                                  abs_err=abs(o.out_sum - expected[o.rank]), tolerance=tol)
        return out, ""

    def reduction_error(self) -> list[Finding]:
        sums, why = self._reduction_sums()
        if why:
            return []
        worst = {str(r): s for r, s in sums.items() if not _within(s)}
        if not worst:
            return []
        bad = [int(r) for r in worst]
        if self.spec.reduction is Reduction.ALL and len(bad) == len(self.obs):
            # Consistent everywhere but wrong: no vote can single out a rank.
            return [self.finding(Kind.REDUCTION_ERROR, [], ReductionError(ranks=worst),
                                 ambiguous=True)]
        return [self.finding(Kind.REDUCTION_ERROR, bad, ReductionError(ranks=worst))]


def _within(s: RankSum) -> bool:
    """A correct reduction's output: finite and within the tolerance."""
    return math.isfinite(s.output_sum) and s.abs_err <= s.tolerance


def _who(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, sorted(ranks)))}"
