"""Desync: members of one collective disagree on what they are calling.

Checked on metadata alone (entry records), so it fires even when the mismatched call then
hangs or crashes. Shapes are compared through numel, which is what the transport moves;
a reshaped view of the same size is not a desync.
"""

from __future__ import annotations

from collections import defaultdict

from .model import Finding, Meta
from .verdicts import majority

_FIELDS = ("op", "dtype", "numel_in", "numel_out", "redop", "root", "in_splits", "out_splits")


def desync(run: str, group: str, seq: int, metas: dict[int, Meta]) -> list[Finding]:
    by_sig: dict[tuple, list[int]] = defaultdict(list)
    for rank, m in metas.items():
        by_sig[m.signature()].append(rank)
    if len(by_sig) < 2:
        return []
    winner, sides = majority(by_sig)
    variants = []
    for ranks in sides:
        m = metas[ranks[0]]
        variants.append({"ranks": sorted(ranks), "op": m.op, "dtype": m.dtype,
                         "numel_in": m.numel_in, "numel_out": m.numel_out,
                         "shape_in": list(m.in_shape), "redop": m.redop, "root": m.root,
                         "splits": [list(m.in_splits), list(m.out_splits)],
                         "callsites": sorted({metas[r].callsite for r in ranks})})
    sigs = [metas[s[0]].signature() for s in sides]
    differ = [f for i, f in enumerate(_FIELDS) if len({sig[i] for sig in sigs}) > 1]
    culprits = [r for s in sides[1:] for r in s] if winner is not None else \
        [r for s in sides for r in s]
    first = metas[culprits[0]]
    return [Finding(
        kind="desync", run=run, op=metas[sides[0][0]].op, group=group, seq=seq,
        step=min(m.step for m in metas.values()), culprits=sorted(culprits),
        hosts=sorted({metas[r].host for r in culprits}), callsite=first.callsite,
        detail={"fields": differ, "variants": variants}, ambiguous=winner is None,
        t=max(m.t_enter for m in metas.values()))]
