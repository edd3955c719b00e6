"""Desync: members of one collective disagree on what they are calling.

Checked on metadata alone (entry records), so it fires even when the mismatched call then
hangs or crashes. Shapes are compared through numel, which is what the transport moves;
a reshaped view of the same size is not a desync.
"""

from __future__ import annotations

from collections import defaultdict

from ..wire.ops import AGREE_ALL, BY_NAME
from .findings import Desync, Finding, Kind, Variant
from .model import Meta
from .verdicts import majority

_P2P = {"send", "recv"}


def agreed_fields(metas: dict[int, Meta]) -> tuple[str, ...]:
    """What members must agree on: the op's own list (root-only sides, uneven splits
    agree on less), or everything when they do not even agree on the op."""
    ops = {m.op for m in metas.values()}
    spec = BY_NAME.get(next(iter(ops))) if len(ops) == 1 else None
    return spec.agree if spec is not None else AGREE_ALL


def _views(metas: dict[int, Meta]) -> dict[int, dict[str, object]]:
    """Per rank, the values that must agree. A p2p message is one send and one recv:
    they agree on dtype and on the element count that travels."""
    if {m.op for m in metas.values()} <= _P2P:
        return {r: {"op": "send/recv", "dtype": m.dtype,
                    "numel": m.numel_in if m.op == "send" else m.numel_out}
                for r, m in metas.items()}
    fields = agreed_fields(metas)
    return {r: {f: getattr(m, f) for f in fields} for r, m in metas.items()}


def desync(run: str, group: str, seq: int, metas: dict[int, Meta]) -> list[Finding]:
    views = _views(metas)
    by_sig: dict[tuple, list[int]] = defaultdict(list)
    for rank, view in views.items():
        by_sig[tuple(view.values())].append(rank)
    if len(by_sig) < 2:
        return []
    winner, sides = majority(by_sig)
    variants = []
    for ranks in sides:
        m = metas[ranks[0]]
        variants.append(Variant(ranks=sorted(ranks), op=m.op, dtype=m.dtype,
                                numel_in=m.numel_in, numel_out=m.numel_out,
                                shape_in=list(m.in_shape), redop=m.redop, root=m.root,
                                splits=(list(m.in_splits), list(m.out_splits)),
                                callsites=sorted({metas[r].callsite for r in ranks})))
    differ = [f for f in views[sides[0][0]] if len({views[s[0]][f] for s in sides}) > 1]
    culprits = [r for s in sides[1:] for r in s] if winner is not None else \
        [r for s in sides for r in s]
    first = metas[culprits[0]]
    return [Finding(
        kind=Kind.DESYNC, run=run, op=metas[sides[0][0]].op, group=group, seq=seq,
        step=min(m.step for m in metas.values()), culprits=sorted(culprits),
        hosts=sorted({metas[r].host for r in culprits}), callsite=first.callsite,
        detail=Desync(fields=differ, variants=variants), ambiguous=winner is None,
        t=max(m.t_enter for m in metas.values()))]
