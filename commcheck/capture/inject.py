"""Fault injection for exercising the checker on a real cluster (off unless configured).

Spec: ``KIND:key=value,...`` entries separated by ``;``, e.g.
``bitflip:rank=2,op=all_reduce,call=40`` flips one bit of the output of rank 2's 40th
all_reduce (calls count from 1 per op and rank), after the real collective and before the
hash. Keys: ``rank`` (global), ``op`` (canonical name or alias), ``call``; for ``bitflip``
also ``bit`` (bit within the element, default 0), ``elem`` (element index within the
target, default the middle) and ``chunk`` (gathered ops: which group rank's chunk is hit,
default the next rank's, so it reads as a corrupted link). ``swap`` exchanges output chunks
``a`` and ``b`` (default 0 and 1) of a gathered op: a permuted all_gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError
from ..ops import BY_NAME

KINDS = ("bitflip", "swap")
_INT_KEYS = {"rank", "call", "bit", "elem", "chunk", "a", "b"}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    op: str
    call: int
    bit: int = 0
    elem: int = -1
    chunk: int = -1
    a: int = 0
    b: int = 1


def parse(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, rest = part.partition(":")
        if kind not in KINDS:
            raise ConfigError(f"commcheck inject: unknown fault kind {kind!r} in {part!r} "
                              f"(known: {', '.join(KINDS)})")
        kw: dict[str, object] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in _INT_KEYS | {"op"}:
                raise ConfigError(f"commcheck inject: bad item {item!r} in {part!r}")
            if key == "op":
                if value not in BY_NAME:
                    raise ConfigError(f"commcheck inject: unknown op {value!r} in {part!r}")
                kw[key] = BY_NAME[value].name
            else:
                try:
                    kw[key] = int(value)
                except ValueError:
                    raise ConfigError(f"commcheck inject: {key}={value!r} is not an integer "
                                      f"in {part!r}") from None
        missing = {"rank", "op", "call"} - kw.keys()
        if missing:
            raise ConfigError(f"commcheck inject: {part!r} lacks {', '.join(sorted(missing))}")
        faults.append(Fault(kind=kind, **kw))  # type: ignore[arg-type]
    return faults


class Injector:
    """Counts calls per op on this rank and corrupts the outputs the spec names."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.calls: dict[str, int] = {}

    def count(self, op: str) -> list[Fault]:
        """Advance the op's call counter; return the faults due on this call."""
        if not self.faults:
            return []
        n = self.calls[op] = self.calls.get(op, 0) + 1
        return [f for f in self.faults if f.op == op and f.call == n]

    @staticmethod
    def apply(fault: Fault, chunks: list[torch.Tensor], group_rank: int) -> None:
        """Corrupt ``chunks`` (the output, cut per rank where the op has chunks) in place."""
        if fault.kind == "swap":
            if len(chunks) > max(fault.a, fault.b):
                a, b = chunks[fault.a], chunks[fault.b]
                tmp = a.clone()
                a.copy_(b)
                b.copy_(tmp)
            return
        if len(chunks) > 1:
            target = chunks[fault.chunk if fault.chunk >= 0 else (group_rank + 1) % len(chunks)]
        else:
            target = chunks[0]
        if target.numel() == 0:
            return
        elem = fault.elem if fault.elem >= 0 else target.numel() // 2
        flat = target.view(-1) if target.is_contiguous() else None
        if flat is None:
            raise ValueError("bitflip target is not contiguous")
        raw = flat[elem:elem + 1].view(torch.uint8)
        raw[fault.bit // 8] ^= 1 << (fault.bit % 8)
