"""Engine-wide ids for what batches carry as batch-local indices.

Every batch has its own string and group tables; the fast path maps them to engine-global
ids once per batch (a few dict lookups per *table entry*, never per record), so whole
columns can be compared across batches and ranks with numpy.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

from ..wire.ops import BY_NAME, Reduction, Split
from .model import group_label
from .verdicts import _REDUCTION_CHECKED, _UNIT

# What the vectorised verdict may decide for an op (anything else goes to Verdicts).
RED_NONE, RED_ALL, RED_OTHER, RED_SCATTER = 0, 1, 2, 3


@dataclass
class Window:
    """One (run, group identity): the unit rows are keyed in, by per-group sequence."""

    run: str
    name: str
    ranks: tuple[int, ...]
    cls: int  # index of the size-class table holding this window's rows
    label: str = ""
    cols: dict[int, int] = field(default_factory=dict)

    def col(self, rank: int) -> int:
        c = self.cols.get(rank)
        if c is None:
            c = self.cols[rank] = bisect_left(self.ranks, rank)
        return c


class Ids:
    def __init__(self) -> None:
        self.strings: list[str] = []
        self._sid: dict[str, int] = {}
        self.hosts: list[str] = []
        self._hid: dict[str, int] = {}
        self.windows: list[Window] = []
        self._wid: dict[tuple[str, str, tuple[int, ...]], int] = {}
        # (run, name) -> the last ranks list seen and its window: comparing two lists is
        # cheaper than hashing a 1024-rank tuple for every batch.
        self._recent: dict[tuple[str, str], tuple[list[int], int]] = {}
        self._classes: dict[int, int] = {}  # group size -> table index
        self.sizes: list[int] = []  # table index -> group size
        # Per global string id: what the string means as an op, a reduce op or a dtype.
        self._props: list[tuple[bool, bool, int, bool, bool, float, bool, bool]] = []
        self._arrays: dict[str, np.ndarray] | None = None
        self._rank_table: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    # -- strings ---------------------------------------------------------------------------

    def string_ids(self, strings: list[str]) -> np.ndarray:
        out = np.empty(len(strings), dtype=np.int64)
        sid = self._sid
        for i, s in enumerate(strings):
            g = sid.get(s)
            if g is None:
                g = sid[s] = len(self.strings)
                self.strings.append(s)
                self._props.append(_props(s))
                self._arrays = None
            out[i] = g
        return out

    def prop(self, name: str) -> np.ndarray:
        """Per global string id: known, replicated, reduction (RED_*), reduce-checked, avg,
        unit, gather (an all_gather: whole input in, one output chunk per member), a2a (an
        all_to_all: one input and one output chunk per member)."""
        if self._arrays is None:
            cols = list(zip(*self._props, strict=True)) if self._props else [()] * 8
            names = ("known", "replicated", "reduction", "red_checked", "avg", "unit",
                     "gather", "a2a")
            types = (bool, bool, np.int8, bool, bool, np.float64, bool, bool)
            self._arrays = {n: np.array(c, dtype=t) for n, c, t in zip(names, cols, types,
                                                                         strict=True)}
        return self._arrays[name]

    def host_id(self, host: str) -> int:
        h = self._hid.get(host)
        if h is None:
            h = self._hid[host] = len(self.hosts)
            self.hosts.append(host)
        return h

    # -- windows ---------------------------------------------------------------------------

    def window_ids(self, run: str, groups: list[tuple[str, list[int]]],
                   rank: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Global window id and the sending rank's member index for each batch group; the
        list holds window ids created by this call (the caller sizes their maps)."""
        wids = np.empty(len(groups), dtype=np.int64)
        cols = np.empty(len(groups), dtype=np.int64)
        new: list[int] = []
        for i, (name, ranks) in enumerate(groups):
            recent = self._recent.get((run, name))
            if recent is not None and recent[0] == ranks:
                w = recent[1]
            else:
                w = self._window_id(run, name, ranks, new)
                self._recent[(run, name)] = (ranks, w)
            wids[i] = w
            cols[i] = self.windows[w].col(rank)
        return wids, cols, new

    def window_of(self, gid: tuple[str, str, tuple[int, ...]]) -> int | None:
        """The window of (run, name, ranks), if there is one."""
        return self._wid.get(gid)

    def _window_id(self, run: str, name: str, ranks: list[int], new: list[int]) -> int:
        """The window of (run, name, ranks), created (and added to ``new``) if need be."""
        key = (run, name, tuple(ranks))
        w = self._wid.get(key)
        if w is None:
            w = self._wid[key] = len(self.windows)
            self.windows.append(Window(run, name, key[2], self._table_of_size(len(ranks)),
                                       group_label(name, key[2])))
            new.append(w)
        return w

    def _table_of_size(self, n: int) -> int:
        """The index of the size-class table for groups of ``n``, created if need be."""
        cls = self._classes.get(n)
        if cls is None:
            cls = self._classes[n] = len(self.sizes)
            self.sizes.append(n)
        return cls

    def rank_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every window's ranks in one flat array: (offset per window, size per window,
        flat ranks); extended by the windows added since (windows are only appended)."""
        n = len(self.windows)
        table = self._rank_table
        if table is None or table[0] != n:
            had, _, sizes, flat = table or (0, None, np.zeros(0, np.int64),
                                            np.zeros(0, np.int64))
            new = self.windows[had:]
            more = np.array([len(w.ranks) for w in new], np.int64)
            sizes = np.concatenate([sizes, more])
            flat = np.concatenate([flat, np.fromiter((r for w in new for r in w.ranks),
                                                     np.int64, int(more.sum()))])
            offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            table = self._rank_table = (n, offs, sizes, flat)
        return table[1:]


def _props(s: str) -> tuple[bool, bool, int, bool, bool, float, bool, bool]:
    spec = BY_NAME.get(s)
    red = RED_NONE
    if spec is not None and spec.reduction is not Reduction.NONE:
        red = {Reduction.ALL: RED_ALL, Reduction.SCATTER: RED_SCATTER}.get(spec.reduction,
                                                                         RED_OTHER)
    gather = bool(spec and spec.replicated and spec.input_split is Split.NONE
                  and spec.output_split in (Split.LIST, Split.FLAT)
                  and not spec.output_on_root_only)
    cut = (Split.LIST, Split.FLAT)
    a2a = bool(spec and not spec.replicated and spec.reduction is Reduction.NONE
               and spec.input_split in cut and spec.output_split in cut)
    if spec is not None and spec.reduction is Reduction.SCATTER and \
            spec.input_split not in (Split.LIST, Split.FLAT):
        red = RED_OTHER  # coalesced: no per-rank input chunks to check against
    return (spec is not None, bool(spec and spec.replicated), red, s in _REDUCTION_CHECKED,
            s == "AVG", _UNIT.get(s, 2.0**-52), gather, a2a)
