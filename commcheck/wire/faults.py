"""What fault injection did on a rank, as it travels in the goodbye's counters.

A rank with ``COMMCHECK_INJECT`` faults says at goodbye which of them never fired and how
many calls of each op it recorded (under the names faults are matched against), so that a
fault aimed at an op the rank never recorded under that name (``all_reduce`` on a DDP job,
whose gradients record as ``ddp_allreduce``) is reported instead of silently doing nothing.
The goodbye's counters are a flat ``{str: int}`` map; these helpers are the only code that
writes or reads its ``inject.*`` keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

UNFIRED = "inject.unfired:"  # + the fault as written ("bitflip:rank=2,op=all_reduce,call=21")
RECORDED = "inject.recorded:"  # + an op name: calls of it this rank recorded


class FaultTally(msgspec.Struct, kw_only=True):
    """One rank's faults that never fired, and the ops it recorded with their counts."""

    rank: int
    unfired: list[str]
    recorded: dict[str, int]


def to_counters(unfired: Iterable[str], recorded: Mapping[str, int]) -> dict[str, int]:
    out = {UNFIRED + f: 1 for f in unfired}
    out.update((RECORDED + op, int(n)) for op, n in recorded.items())
    return out


def from_counters(rank: int, counters: Mapping[str, int]) -> FaultTally | None:
    """The tally in a rank's counters; None when it had no unfired fault."""
    unfired = sorted(k.removeprefix(UNFIRED) for k in counters if k.startswith(UNFIRED))
    if not unfired:
        return None
    recorded = {k.removeprefix(RECORDED): n for k, n in sorted(counters.items())
                if k.startswith(RECORDED)}
    return FaultTally(rank=rank, unfired=unfired, recorded=recorded)


def describe_recorded(recorded: Mapping[str, int]) -> str:
    """``ddp_allreduce ×30, barrier ×2`` (most first), or ``no collective``."""
    if not recorded:
        return "no collective"
    return ", ".join(f"{op} ×{n}" for op, n in sorted(recorded.items(),
                                                       key=lambda kv: (-kv[1], kv[0])))
