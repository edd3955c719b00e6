"""Storage of the fast path: open collectives as rows of fixed-width cells.

A *row* is one open key (run, group identity, seq); its *cells* are the group's members,
in group-rank order. Rows of every group with the same size share one :class:`Table`, so a
block of records from many groups is placed with a handful of numpy calls. Each window
(run, group identity) finds its rows through a ring (:class:`Rings`) indexed by sequence
number, so a lookup is an array index, not a dict probe. Memory is bounded by the open
window: closed rows are reused, and both structures have caps enforced by the caller.
"""

from __future__ import annotations

import numpy as np

from ..wire import REC_DTYPE
from .ids import Ids
from .model import Meta

SHAPE_DIMS = 4  # shapes with more dims take the exact path

# Entry metadata of one member: what desync compares and what a Meta is rebuilt from.
# Packed to a multiple of 8 bytes so two cells compare as uint64 words.
META_DTYPE = np.dtype([
    ("op", "<u4"), ("dtype", "<u4"), ("redop", "<u4"), ("callsite", "<u4"), ("host", "<u4"),
    ("root", "<i4"), ("peer", "<i4"), ("in_ndim", "u1"), ("out_ndim", "u1"), ("pad", "<u2"),
    ("numel_in", "<u8"), ("numel_out", "<u8"), ("step", "<i8"), ("t_enter", "<f8"),
    ("in_shape", "<u4", (SHAPE_DIMS,)), ("out_shape", "<u4", (SHAPE_DIMS,)),
])
META_WORDS = META_DTYPE.itemsize // 8
assert META_DTYPE.itemsize % 8 == 0

# What a member reported at completion: the contiguous run of REC_DTYPE from t_done to
# out_inf, copied as raw bytes (NaN/Inf counts are always zero here: such records take the
# exact path). The hash algorithm and flags are kept apart (algo needs a global id).
_OBS_FIRST, _OBS_LAST = "t_done", "out_inf"
_names = REC_DTYPE.names[REC_DTYPE.names.index(_OBS_FIRST):REC_DTYPE.names.index(_OBS_LAST) + 1]
OBS_START = REC_DTYPE.fields[_OBS_FIRST][1]
OBS_DTYPE = np.dtype([(f, REC_DTYPE.fields[f][0]) for f in _names])
OBS_END = OBS_START + OBS_DTYPE.itemsize
assert REC_DTYPE.fields[_OBS_LAST][1] + 8 == OBS_END  # contiguous in the wire record
# A whole cell as one opaque item (fancy indexing copies it with one memcpy).
META_ITEM = np.dtype((np.void, META_DTYPE.itemsize))
OBS_ITEM = np.dtype((np.void, OBS_DTYPE.itemsize))

ENTERED, COMPLETE = 1, 2
EMPTY, EXACT = -1, -2  # ring values besides a row index: no open row / key on the exact path

CELL_BYTES = META_DTYPE.itemsize + OBS_DTYPE.itemsize + 1 + 10 * 8


# Row arrays of a Table that are often all one value in the rows in use (snapshots)
_FILL = {"cblk": -1, "coff": 0, "sblk": -1, "soff": 0, "exp": 0.0, "exp_abs": 0.0}


class Table:
    """Rows of ``n`` cells for every group of size ``n``; free rows are reused."""

    def __init__(self, n: int, cap: int = 8):
        self.n = n
        self.cap = 0
        # Cells are written as raw words/bytes (structured fancy assignment copies field by
        # field, ten times slower) and read through structured views.
        self.meta_w = np.zeros((0, n, META_WORDS), np.uint64)
        self.obs_b = np.zeros((0, n, OBS_DTYPE.itemsize), np.uint8)
        self.algo = np.zeros((0, n), np.int64)
        self.flags = np.zeros((0, n), np.int64)
        self.state = np.zeros((0, n), np.uint8)
        self.ent_at = np.zeros((0, n), np.int64)  # ticket of the entering record (order)
        self.cmp_at = np.zeros((0, n), np.int64)  # ticket of the completing record
        # A completion's chunks (all_gather, reduce_scatter, all_to_all), kept for the exact
        # path should the row need them: the chunk block holding them (-1: none) and their
        # offset there.
        self.cblk = np.zeros((0, n), np.int64)
        self.coff = np.zeros((0, n), np.int64)
        # An entry's split sizes (uneven all_to_all), kept the same way: in, then out.
        self.sblk = np.zeros((0, n), np.int64)
        self.soff = np.zeros((0, n), np.int64)
        # reduce_scatter: per destination member, the sum (and sum of magnitudes) of the
        # input chunk sums sent to it so far
        self.exp = np.zeros((0, n), np.float64)
        self.exp_abs = np.zeros((0, n), np.float64)
        self.mark = np.zeros((0, n), np.int64)  # scratch: duplicate detection per block
        self.wid = np.zeros(0, np.int64)
        self.seq = np.zeros(0, np.int64)
        self.born = np.zeros(0, np.int64)  # ticket of the record that opened the row
        self.n_ent = np.zeros(0, np.int64)
        self.n_cmp = np.zeros(0, np.int64)
        self.min_t = np.zeros(0, np.float64)
        self.hang = np.zeros(0, bool)
        self.used = np.zeros(0, bool)
        self._free = np.zeros(0, np.int64)
        self._nfree = 0
        self._grow(cap)

    @property
    def rows_open(self) -> int:
        return self.cap - self._nfree

    _ROW_ARRAYS = ("meta_w", "obs_b", "algo", "flags", "state", "ent_at", "cmp_at", "cblk",
                   "coff", "sblk", "soff", "exp", "exp_abs", "wid", "seq", "born", "n_ent",
                   "n_cmp", "min_t", "hang")

    def __getstate__(self) -> dict:
        """Only the rows in use (a snapshot is bounded by the open window, not by the
        table's high-water mark); free rows hold nothing that is read before it is written,
        and ``mark`` is per-block scratch."""
        rows = np.flatnonzero(self.used)
        state = {"n": self.n, "cap": self.cap, "rows": rows,
                 "free": self._free[:self._nfree].copy()}
        for name in self._ROW_ARRAYS:
            part = getattr(self, name)[rows]
            fill = _FILL.get(name)
            # Chunk and split pointers and scatter sums are unset outside a few ops: as
            # often as not ~20 % of the snapshot, saved as their fill value.
            state[name] = fill if fill is not None and (part == fill).all() else part
        return state

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["n"], 0)
        self._grow(state["cap"])
        rows = state["rows"]
        for name in self._ROW_ARRAYS:
            getattr(self, name)[rows] = state[name]  # an array, or its fill value
        self.used[rows] = True
        free = state["free"]
        self._free[:len(free)] = free
        self._nfree = len(free)

    @property
    def nbytes(self) -> int:
        return self.cap * self.n * CELL_BYTES

    def _grow(self, cap: int) -> None:
        old = self.cap
        for name in ("meta_w", "obs_b", "algo", "flags", "state", "ent_at", "cmp_at", "mark",
                     "cblk", "coff", "sblk", "soff", "exp", "exp_abs"):
            a = getattr(self, name)
            # Zeros from calloc: fresh pages are zeroed by the kernel when first touched,
            # where a fill writes every byte of a table that may never be used whole.
            b = np.full((cap, *a.shape[1:]), -1, a.dtype) if name in ("cblk", "sblk") \
                else np.zeros((cap, *a.shape[1:]), a.dtype)
            b[:old] = a
            setattr(self, name, b)
        self.meta = self.meta_w.view(META_DTYPE)[..., 0]
        self.obs = self.obs_b.view(OBS_DTYPE)[..., 0]
        for name in ("wid", "seq", "born", "n_ent", "n_cmp", "min_t", "hang", "used"):
            a = getattr(self, name)
            b = np.zeros(cap, a.dtype)
            b[:old] = a
            setattr(self, name, b)
        free = np.empty(cap, np.int64)
        free[:self._nfree] = self._free[:self._nfree]
        free[self._nfree:self._nfree + cap - old] = np.arange(cap - 1, old - 1, -1)
        self._free, self._nfree, self.cap = free, self._nfree + cap - old, cap

    def alloc(self, k: int) -> np.ndarray:
        if k > self._nfree:
            self._grow(max(2 * self.cap, self.cap + k))
        self._nfree -= k
        rows = self._free[self._nfree:self._nfree + k].copy()
        self.used[rows] = True
        self.min_t[rows] = np.inf
        self.exp[rows] = 0.0
        self.exp_abs[rows] = 0.0
        return rows

    def release(self, rows: np.ndarray) -> None:
        self.state[rows] = 0
        self.cblk[rows] = -1
        self.sblk[rows] = -1
        self.n_ent[rows] = 0
        self.n_cmp[rows] = 0
        self.hang[rows] = False
        self.used[rows] = False
        self._free[self._nfree:self._nfree + len(rows)] = rows
        self._nfree += len(rows)


class Rings:
    """Per window, a power-of-two ring from sequence number to row (or EMPTY / EXACT).

    The ring covers ``[base, base + size)``; ``base`` only moves forward, past keys that
    closed. ``top`` is one past the highest sequence number placed, ``floor`` the lowest
    sequence number still accepted after an eviction.
    """

    def __init__(self) -> None:
        self.flat = np.zeros(0, np.int64)
        self.off = np.zeros(0, np.int64)
        self.size = np.zeros(0, np.int64)
        self.base = np.zeros(0, np.int64)
        self.top = np.zeros(0, np.int64)
        self.floor = np.zeros(0, np.int64)
        self.used = 0
        self.live = 0

    def add(self, count: int, size: int = 8) -> None:
        """Make room for ``count`` new windows, each with an empty ring of ``size``."""
        n = len(self.off)
        for name in ("off", "size", "base", "top", "floor"):
            setattr(self, name, np.concatenate([getattr(self, name),
                                                np.zeros(count, np.int64)]))
        for w in range(n, n + count):
            self.off[w] = self._region(size)
            self.size[w] = size

    def _region(self, size: int) -> int:
        if self.used + size > len(self.flat):
            if self.live + size <= len(self.flat) // 2:
                self._compact()
            if self.used + size > len(self.flat):
                grown = np.full(max(2 * len(self.flat), self.used + size, 64), EMPTY, np.int64)
                grown[:self.used] = self.flat[:self.used]
                self.flat = grown
        off = self.used
        self.used += size
        self.live += size
        return off

    def _compact(self) -> None:
        order = np.argsort(self.off)
        flat = np.full(len(self.flat), EMPTY, np.int64)
        pos = 0
        for w in order.tolist():
            s = int(self.size[w])
            flat[pos:pos + s] = self.flat[self.off[w]:self.off[w] + s]
            self.off[w] = pos
            pos += s
        self.flat, self.used = flat, pos

    def positions(self, w: int) -> np.ndarray:
        """Flat positions of window ``w``'s slots, from ``base`` upwards."""
        s = int(self.size[w])
        return self.off[w] + ((self.base[w] + np.arange(s)) & (s - 1))

    def resize(self, w: int, size: int) -> None:
        """Move window ``w`` to a ring of ``size`` (a power of two covering its span)."""
        old_pos = self.positions(w)
        vals = self.flat[old_pos]
        self.flat[old_pos] = EMPTY
        self.live -= int(self.size[w])
        off = self._region(size)
        seqs = self.base[w] + np.arange(len(vals))
        self.flat[off + (seqs & (size - 1))] = vals
        self.off[w], self.size[w] = off, size

    def slide(self, w: int) -> None:
        """Advance ``base`` past slots with no open key (never past ``top``)."""
        pos = self.positions(w)
        span = int(self.top[w] - self.base[w])
        if span <= 0:
            return
        busy = self.flat[pos[:span]] != EMPTY
        k = int(busy.argmax()) if busy.any() else span
        self.base[w] += k


def meta_list(ids: Ids, m: np.ndarray) -> list[Meta]:
    """The Metas of packed ``META_DTYPE`` cells (ids resolved to strings; rank 0, no
    splits: the caller sets them)."""
    s, hosts = ids.strings, ids.hosts
    f = {name: m[name].tolist() for name in META_DTYPE.names}
    out = []
    for i in range(len(m)):
        ins = tuple(f["in_shape"][i][:f["in_ndim"][i]])
        outs = tuple(f["out_shape"][i][:f["out_ndim"][i]])
        out.append(Meta(0, hosts[f["host"][i]], s[f["op"][i]], s[f["dtype"][i]],
                        f["numel_in"][i], f["numel_out"][i], ins, outs, s[f["redop"][i]],
                        f["root"][i], f["peer"][i], (), (), s[f["callsite"][i]],
                        f["step"][i], f["t_enter"][i]))
    return out
