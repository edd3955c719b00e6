"""Fault injection for exercising the checker on a real cluster (off unless configured).

Spec: ``KIND:key=value,...`` entries separated by ``;``, e.g.
``bitflip:rank=2,op=all_reduce,call=40`` flips one bit of the output of rank 2's 40th
all_reduce (calls count from 1 per canonical op and rank). Keys: ``rank`` (global), ``op``
(canonical name or alias), ``call``. Kinds:

* after the real call, before the hash (what a flaky link or memory does to received data):
  ``bitflip`` (``bit`` within the element, default 0; ``elem`` index, default the middle;
  ``chunk``: for chunked outputs, which group rank's chunk, default the next rank's),
  ``chunk`` (a bitflip in one chunk of a chunked output, e.g. all_to_all: a corrupted link),
  ``p2p`` (a bitflip in a received point-to-point message), ``swap`` (exchange output
  chunks ``a`` and ``b``, default 0 and 1: a permuted all_gather);
* before the call (what a buggy rank does): ``nan`` (a NaN into element ``elem`` of the
  input), ``shape`` (call with the input narrowed by one element: a desync), ``skip`` (do
  not call at all: the others hang).

A fault that never fires is never silent: at exit the rank says on stderr which of its
faults never fired and which ops it recorded, with counts, and its goodbye carries the same
(:mod:`commcheck.wire.faults`) for the report. Faults naming a rank outside the world are
said by rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from ..wire import faults as wire_faults
from ..wire.ops import BY_NAME, P2P, Split
from .config import ConfigError

log = logging.getLogger("commcheck")

AFTER = ("bitflip", "chunk", "p2p", "swap")
BEFORE = ("nan", "shape", "skip")
KINDS = AFTER + BEFORE
_INT_KEYS = {"rank", "call", "bit", "elem", "chunk", "a", "b"}
_CHUNKED = (Split.LIST, Split.FLAT, Split.LISTS)


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

    @property
    def before(self) -> bool:
        return self.kind in BEFORE

    def __str__(self) -> str:
        """The fault as written in ``COMMCHECK_INJECT`` (keys at their default left out)."""
        keys = [f"rank={self.rank}", f"op={self.op}", f"call={self.call}"]
        for f in fields(self)[4:]:
            value = getattr(self, f.name)
            if value != f.default:
                keys.append(f"{f.name}={value}")
        return f"{self.kind}:{','.join(keys)}"


def _check(kind: str, op: str, part: str) -> None:
    spec = BY_NAME[op]
    if kind in ("chunk", "swap") and spec.output_split not in _CHUNKED:
        raise ConfigError(f"commcheck inject: {kind} needs an op with a chunked output, "
                          f"not {op!r}, in {part!r}")
    if kind == "p2p" and spec.p2p is not P2P.RECV:
        raise ConfigError(f"commcheck inject: p2p corrupts a received message; use op=recv "
                          f"in {part!r}")
    if kind in ("nan", "shape") and not spec.input:
        raise ConfigError(f"commcheck inject: {kind} needs an op with an input, not {op!r}, "
                          f"in {part!r}")


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
        _check(kind, str(kw["op"]), part)
        faults.append(Fault(kind=kind, **kw))  # type: ignore[arg-type]
    return faults


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("fault target is not contiguous")
    return t.view(-1)


class Injector:
    """Counts calls per op on this rank and corrupts the calls the spec names."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.calls: dict[str, int] = {}
        self.fired: set[Fault] = set()

    def count(self, op: str) -> list[Fault]:
        """Advance the op's call counter; return the faults due on this call."""
        if not self.faults:
            return []
        n = self.calls[op] = self.calls.get(op, 0) + 1
        due = [f for f in self.faults if f.op == op and f.call == n]
        if due:
            self.fired.update(due)
        return due

    def unfired(self) -> list[Fault]:
        return [f for f in self.faults if f not in self.fired]

    @staticmethod
    def poison(fault: Fault, t: torch.Tensor) -> None:
        """``nan``: one element of the input becomes NaN (integers: left alone)."""
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            flat = _flat(t)
            flat[fault.elem if fault.elem >= 0 else flat.numel() // 2] = float("nan")

    @staticmethod
    def narrow(t: torch.Tensor) -> torch.Tensor:
        """``shape``: the same tensor less its last element along dim 0 (or flattened)."""
        if t.dim() and t.shape[0] > 1:
            return t.narrow(0, 0, t.shape[0] - 1)
        return _flat(t)[:-1]

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
        flat = _flat(target)
        elem = fault.elem if fault.elem >= 0 else flat.numel() // 2
        raw = flat[elem:elem + 1].view(torch.uint8)
        raw[fault.bit // 8] ^= 1 << (fault.bit % 8)


def why_unfired(fault: Fault, calls: dict[str, int], world: int = 0) -> str:
    """One line: why ``fault`` never fired on its rank, from what that rank recorded."""
    if world and not 0 <= fault.rank < world:
        return f"fault {fault} never fired: there is no rank {fault.rank} in a world of {world}"
    n = calls.get(fault.op, 0)
    did = f"recorded {n} {fault.op}" if n else f"recorded no {fault.op}"
    return (f"fault {fault} never fired: rank {fault.rank} {did}; it recorded "
            f"{wire_faults.describe_recorded(calls)}")


class Faulted(Protocol):
    """What the fault tally needs of a rank's session (session.py imports this module)."""

    rank: int
    faults: list[Fault]
    injector: Injector | None

    def on_goodbye(self, fn: Callable[[dict[str, int]], None]) -> None: ...


def attach(session: Faulted) -> None:
    """Make ``session`` say, at stop, which faults never fired (stderr and goodbye)."""
    if session.faults:
        session.on_goodbye(lambda counters: _report(session, counters))


def _report(session: Faulted, counters: dict[str, int]) -> None:
    """At stop: log each unfired fault of this rank (rank 0: also those naming no rank of
    the world) and put them, with the ops recorded, into the goodbye's counters."""
    injector = session.injector
    if injector is None:
        return
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 0
    unfired = injector.unfired()
    if session.rank == 0 and world:
        unfired += [f for f in session.faults if not 0 <= f.rank < world]
    if not unfired:
        return
    for fault in unfired:
        log.warning("commcheck: rank %d: %s", session.rank,
                    why_unfired(fault, injector.calls, world))
    counters.update(wire_faults.to_counters((str(f) for f in unfired), injector.calls))
