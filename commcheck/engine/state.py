"""What the engine keeps per rank and what it counts: written by both of its paths.

The :class:`~.core.Engine` owns one :class:`RankState` per rank and one :class:`EngineStats`;
it hands the stats to the exact and the fast path at construction (each counts what it
decides into them) and the rank states to the fast path with each block (it settles each
rank's last entry).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FunctionType

from .model import Meta, group_label


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
    # (group label, seq) and metadata of the last entry; the fast path sets it lazily
    # (``last_t_enter`` + a maker) so a Meta is only built when a hang needs it.
    _last: tuple[str, Meta] | None = field(default=None, repr=False)
    last_t_enter: float = field(default=-math.inf, repr=False)
    _make_last: Callable[[], tuple[str, Meta]] | None = field(default=None, repr=False,
                                                             compare=False)

    @property
    def last(self) -> tuple[str, Meta] | None:
        if self._make_last is not None:
            self._last, self._make_last = self._make_last(), None
        return self._last

    @last.setter
    def last(self, value: tuple[str, Meta] | None) -> None:
        self._last, self._make_last = value, None
        self.last_t_enter = value[1].t_enter if value is not None else -math.inf

    def set_last_lazily(self, t_enter: float, make: Callable[[], tuple[str, Meta]]) -> None:
        self._make_last, self.last_t_enter = make, t_enter

    def entered(self, gname: str, granks: tuple[int, ...], seq: int, meta: Meta) -> None:
        """The rank entered a collective: its latest entry (by t_enter) is its ``last``,
        for missing_rank details."""
        if self.last is None or meta.t_enter >= self.last[1].t_enter:
            self.last = (f"{group_label(gname, granks)} seq {seq}", meta)

    def __getstate__(self) -> dict:
        """Pickled (in the collector's snapshot) with a maker that is a closure built."""
        state = dict(self.__dict__)
        if isinstance(self._make_last, FunctionType):
            state["_last"], state["_make_last"] = self.last, None
        return state


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
