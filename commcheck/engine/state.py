"""What the engine keeps per rank and what it counts: written by both of its paths.

The :class:`~.core.Engine` owns one :class:`RankState` per rank and one :class:`EngineStats`;
it hands the stats to the exact and the fast path at construction (each counts what it
decides into them) and the rank states to the fast path with each block (it settles each
rank's last entry and last completion).

A rank's process, as its node's relay sees it (:class:`Liveness`, given to
``Engine.observe``), is kept here too; :func:`condition` says what the rank is doing from
that and from its records.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from types import FunctionType
from typing import NamedTuple

import msgspec

from ..wire import CallFailure
from .model import Key, Meta, group_label

ALIVE, STOPPED, GONE = "alive", "stopped", "gone"  # Liveness.state
MAX_FAILED = 64  # failed calls kept per rank (RankState.failed)


class Liveness(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's process as its node's relay saw it (``Engine.observe``)."""

    state: str  # ALIVE (running or sleeping), STOPPED (SIGSTOP, a debugger) or GONE (exited,
    #             or a zombie)
    goodbye: bool = False  # it said goodbye (ended its run normally)
    idle_s: float = 0.0  # seconds since it last wrote a record, at ``seen_t``
    exit_code: int = -1  # once gone: its exit status; -1 when not known (or killed by a signal)
    signal: int = 0  # once gone: the signal that ended it; 0 when none was seen
    pid: int = 0  # 0 when not known
    seen_t: float = 0.0  # when the relay saw this (wall clock, s); 0: the ``now`` of observe()
    host: str = ""  # the node: names the host of a rank the engine has no record from yet

    def idle_at(self, now: float) -> float:
        """Seconds without a record at ``now``: what the relay saw, plus the time since (the
        time since is left out at the end of a run, ``now`` infinite)."""
        if not math.isfinite(now):
            return self.idle_s
        return self.idle_s + max(0.0, now - self.seen_t)


class Condition(str, Enum):
    """What a rank is doing (:func:`condition`). The value is the string findings hold."""

    DEAD = "dead"  # its process is gone and it never said goodbye
    FROZEN = "frozen"  # stopped (SIGSTOP, a debugger), or alive but silent for the hang
    #                    timeout while not inside a collective
    BLOCKED = "blocked"  # inside a collective: the last one it entered has no completion
    #                      from it
    PROGRESSING = "progressing"  # none of the above
    FINISHED = "finished"  # it said goodbye

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Call(NamedTuple):
    """A collective one rank entered or completed, as that rank's record described it."""

    key: Key
    meta: Meta
    t_done: float = math.nan  # its completion, for a completed call

    @property
    def at(self) -> str:
        """``"<group> seq <n>"``, as findings name a collective."""
        return f"{group_label(self.key[1], self.key[2])} seq {self.key[3]}"


def _lazy(name: str) -> property:
    """A Call kept as ``_<name>``, or built on first read by the maker ``_make_<name>``."""
    value, maker = f"_{name}", f"_make_{name}"

    def get(self: RankState) -> Call | None:
        make = getattr(self, maker)
        if make is not None:
            setattr(self, value, make())
            setattr(self, maker, None)
        return getattr(self, value)

    return property(get)


@dataclass
class RankState:
    host: str
    node: int = -1
    hello: bool = False
    goodbye: bool = False
    records: int = 0
    last_t: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    run: str = ""  # the run this rank last reported under (changes after an elastic restart)
    liveness: Liveness | None = None  # the relay's latest view of its process
    # Collectives whose real call raised on this rank after torch accepted it: key -> the
    # error ("RuntimeError: Connection closed by peer ..."), the latest MAX_FAILED
    failed: dict[Key, str] = field(default_factory=dict)
    # Its last entry (the latest t_enter) and its last completion (the latest to arrive);
    # the fast path sets them lazily (a maker) so a Meta is only built when a report needs it.
    _last: Call | None = field(default=None, repr=False)
    last_t_enter: float = field(default=-math.inf, repr=False)
    _make_last: Callable[[], Call] | None = field(default=None, repr=False, compare=False)
    _last_done: Call | None = field(default=None, repr=False)
    _make_last_done: Callable[[], Call] | None = field(default=None, repr=False, compare=False)
    # how its goodbye said the process ends: wire.Ending's fields (how, code, signal, error,
    # thread); None without a goodbye, or from an older commcheck
    ending: tuple | None = None

    last = _lazy("last")  # the collective it entered last (by t_enter), or None
    last_done = _lazy("last_done")  # the collective it completed last (by arrival), or None

    def note_failed(self, run: str, failures: list[CallFailure]) -> None:
        for f in failures:
            self.failed[(run, f.group, tuple(f.ranks), f.seq)] = f.error
        while len(self.failed) > MAX_FAILED:
            del self.failed[next(iter(self.failed))]

    @property
    def gone(self) -> bool:
        """Its relay saw its process gone (exited, killed, a zombie)."""
        return self.liveness is not None and self.liveness.state == GONE

    def set_last(self, call: Call | None) -> None:
        self._last, self._make_last = call, None
        self.last_t_enter = call.meta.t_enter if call is not None else -math.inf

    def set_last_lazily(self, t_enter: float, make: Callable[[], Call]) -> None:
        self._make_last, self.last_t_enter = make, t_enter

    def set_last_done_lazily(self, make: Callable[[], Call]) -> None:
        self._make_last_done = make

    def entered(self, key: Key, meta: Meta) -> None:
        """The rank entered a collective: its latest entry (by t_enter) is its ``last``."""
        if self.last is None or meta.t_enter >= self.last.meta.t_enter:
            self.set_last(Call(key, meta))

    def completed(self, key: Key, meta: Meta, t_done: float) -> None:
        """The rank completed a collective: the latest to arrive is its ``last_done``."""
        self._last_done, self._make_last_done = Call(key, meta, t_done), None

    @property
    def said_goodbye(self) -> bool:
        """In its records (the goodbye message) or as the relay saw it."""
        return self.goodbye or (self.liveness is not None and self.liveness.goodbye)

    def __getstate__(self) -> dict:
        """Pickled (in the collector's snapshot) with any maker that is a closure built."""
        state = dict(self.__dict__)
        for name in ("last", "last_done"):
            if isinstance(state.get(f"_make_{name}"), FunctionType):
                state[f"_{name}"], state[f"_make_{name}"] = getattr(self, name), None
        return state


def condition(state: RankState, now: float, hang_timeout: float, blocked: bool) -> Condition:
    """What the rank is doing at ``now``: finished, dead, frozen, blocked or progressing, in
    that order of precedence. ``blocked``: the last collective it entered has no
    completion from it (the engine looks that up). Without liveness a rank is never dead
    or frozen: its records alone cannot tell."""
    if state.said_goodbye:
        return Condition.FINISHED
    lv = state.liveness
    if lv is not None:
        if lv.state == GONE:
            return Condition.DEAD
        if lv.state == STOPPED or (not blocked and lv.idle_at(now) >= hang_timeout):
            return Condition.FROZEN
    return Condition.BLOCKED if blocked else Condition.PROGRESSING


class RankCondition(NamedTuple):
    """A rank's :class:`Condition` with what it rests on (``Engine.condition``)."""

    condition: Condition
    last: Call | None  # the collective it entered last
    blocked_since: float | None  # when blocked: when it entered ``last`` (its t_enter)
    idle_s: float | None  # seconds without a record (the relay's view); None without one


@dataclass
class EngineStats:
    records: int = 0
    verified: int = 0
    findings: int = 0
    open_keys: int = 0
    world: int = 0
    nan_folded: int = 0
    evicted: int = 0  # open keys dropped to keep memory bounded (a rank far behind)
    late: int = 0  # records that arrived for an evicted key, dropped
    # Per op name (as recorded: "ddp_allreduce", "all_gather_single", ...): completion
    # records received from every rank, and collectives verified.
    recorded_by_op: dict[str, int] = field(default_factory=dict)
    verified_by_op: dict[str, int] = field(default_factory=dict)

    def __setstate__(self, d: dict) -> None:
        """Stats pickled before the per-op counts start them empty."""
        self.__dict__.update({"recorded_by_op": {}, "verified_by_op": {}, **d})

    def verified_op(self, op: str, n: int = 1) -> None:
        self.verified_by_op[op] = self.verified_by_op.get(op, 0) + n

    def op_counters(self) -> dict[str, int]:
        """The per-op counts as collector counters: ``recorded.op.<op>``, ``verified.op.<op>``."""
        return {**{f"recorded.op.{k}": v for k, v in self.recorded_by_op.items()},
                **{f"verified.op.{k}": v for k, v in self.verified_by_op.items()}}
