"""Who arrived last at each collective, from each member's own wait (docs/stragglers.md).

Hosts' clocks disagree, so arrival order never comes from comparing ``t_enter`` across
ranks. A synchronous collective completes on every member at about the same moment, so a
member's wait (``t_exit − t_enter``, both on its own clock) is how long it waited for the
last arrival plus the transfer: the member that waited least arrived last, the others
waited ``wait − min wait`` for it, and ``min wait`` is the transfer itself. Async calls use
``t_done`` (when their completion was seen) instead of ``t_exit``.

:class:`Lateness` joins the completion records of a block (the fast path's
:class:`~.block.RecordBlock`) per key with numpy, never one Python object per record: a
key's running aggregate (count, smallest and second smallest wait, who waited least, sum)
lives in a row of an open table until every member reported, then becomes one
:data:`ARRIVAL_DTYPE` row. It also keeps the per-rank tallies the report and the metrics
show. Memory is bounded by ``max_open`` keys (the oldest are dropped, counted).
"""

from __future__ import annotations

import numpy as np

from ..wire import F_ASYNC, F_REJECTED, PHASE_COMPLETE
from .block import RecordBlock
from .ids import Ids

DEFAULT_MAX_OPEN = 1 << 17
_SEQ_BITS = 40
GAP_BINS = 16  # per-rank histogram of "how far behind the previous arrival" when last:
GAP_FLOOR = 1e-4  # bin 0 below 0.1 ms, bin b in [0.1 ms · 2^(b-1), 0.1 ms · 2^b)

# One finished collective: who arrived last and what it cost the others.
ARRIVAL_DTYPE = np.dtype([
    ("wid", "<i8"), ("seq", "<i8"), ("n", "<i8"),
    ("last", "<i8"),  # global rank that waited least: the last arrival
    ("gap", "<f8"),  # second smallest wait − smallest: how far behind the previous arrival
    ("cost", "<f8"),  # Σ over the others of (their wait − its wait): what they waited for it
    ("others", "<f8"),  # Σ of the others' waits: their time in this collective
    ("transfer", "<f8"),  # the smallest wait: the collective's time once all had arrived
    ("t_ref", "<f8"),  # the completion on member 0's clock (one clock per group's windows)
    ("step", "<i8"), ("site", "<i8"), ("op", "<i8"), ("numel", "<f8"),
])

_OPEN_FIELDS = (("key", np.int64), ("cnt", np.int64), ("min", np.float64),
                ("second", np.float64), ("sum", np.float64), ("last", np.int64),
                ("t_ref", np.float64), ("step", np.int64), ("site", np.int64),
                ("op", np.int64), ("numel", np.float64), ("born", np.int64))


class Lateness:
    """Completion records in (:meth:`feed`), finished collectives out, per-rank tallies
    kept (:meth:`counters`)."""

    def __init__(self, max_open: int = DEFAULT_MAX_OPEN):
        self.max_open = max_open
        # The open keys, ascending, and each one's row of the open table: found for a
        # block's keys with one searchsorted (a dict costs a Python call per key).
        self.keys = np.zeros(0, np.int64)
        self.rows = np.zeros(0, np.int64)
        self.free = np.zeros(0, np.int64)  # a stack of free rows: the first ``nfree``
        self.nfree = 0
        self.cols: dict[str, np.ndarray] = {n: np.zeros(0, t) for n, t in _OPEN_FIELDS}
        self.born = 0
        self.dropped = 0  # open keys dropped to stay within max_open
        # Per global rank: collectives, seconds waited, times last, seconds the others
        # waited for it, histogram of its gaps when last; and its host id.
        self.calls = np.zeros(0, np.int64)
        self.wait = np.zeros(0, np.float64)
        self.last = np.zeros(0, np.int64)
        self.cost = np.zeros(0, np.float64)
        self.gaps = np.zeros((0, GAP_BINS), np.int64)
        self.host = np.zeros(0, np.int64)  # global host id (Ids.hosts) of ranks once last

    def __setstate__(self, d: dict) -> None:
        """One pickled while free rows were a list keeps them, as a stack."""
        self.__dict__.update(d)
        if isinstance(self.free, list):
            self.free, self.nfree = np.array(self.free, np.int64), len(self.free)

    # -- the block ----------------------------------------------------------------------------

    def feed(self, blk: RecordBlock, ids: Ids) -> np.ndarray:
        """The block's completion records joined into the open keys; returns the
        collectives every member has now reported (``ARRIVAL_DTYPE`` rows)."""
        idx = np.flatnonzero(blk.phase == PHASE_COMPLETE)
        flags = blk.flags[idx]
        t1 = blk.rec["t_exit"].copy()[idx]  # a whole column's copy, then an aligned gather
        is_async = (flags & F_ASYNC) != 0
        if is_async.any():
            t1 = np.where(is_async, blk.rec["t_done"][idx], t1)
        meta = blk.meta
        wait = t1 - blk.t_enter[idx]
        offs, sizes, flat = ids.rank_table()
        wid, seq = blk.wid[idx], blk.seq[idx]  # huge ones (>= 2**62, seq 0 here) fail below
        take = ((flags & F_REJECTED) == 0) & (wait >= 0) & (wait < 1e6) & \
            (sizes[wid] >= 2) & (seq < (1 << _SEQ_BITS)) & ~blk.huge[idx]
        if not take.all():
            idx, wid, seq, wait, t1 = idx[take], wid[take], seq[take], wait[take], t1[take]
        if not len(idx):
            return np.zeros(0, ARRIVAL_DTYPE)
        member = blk.member[idx]
        rank = flat[offs[wid] + member]
        self._tally_calls(rank, wait)
        key = (wid << _SEQ_BITS) | seq
        order = np.lexsort((wait, key))
        k, w = key[order], wait[order]
        n = len(k)
        first = np.concatenate([[0], np.flatnonzero(k[1:] != k[:-1]) + 1])
        cnt = np.diff(first, append=n)
        at = idx[order[first]]  # per key: the record of the member that waited least
        self.host[rank[order[first]]] = meta["host"][at]  # the hosts of last arrivals
        zero = np.flatnonzero(member[order] == 0)  # per key: member 0's, on its clock
        t_ref = np.full(len(first), np.nan)
        t_ref[np.searchsorted(first, zero, "right") - 1] = t1[order[zero]]
        part = {"key": k[first], "cnt": cnt, "min": w[first],
                "second": np.where(cnt >= 2, w[np.minimum(first + 1, n - 1)], np.inf),
                "sum": np.add.reduceat(w, first), "last": rank[order[first]], "t_ref": t_ref,
                "step": meta["step"][at], "site": meta["callsite"][at].astype(np.int64),
                "op": blk.op[at].astype(np.int64),
                "numel": np.maximum(meta["numel_in"][at], meta["numel_out"][at]).astype(
                    np.float64)}
        return self._merge(part, sizes)

    def _tally_calls(self, rank: np.ndarray, wait: np.ndarray) -> None:
        top = int(rank.max()) + 1
        if top > len(self.calls):
            self._grow_ranks(top)
        self.calls[:top] += np.bincount(rank, minlength=top)
        self.wait[:top] += np.bincount(rank, weights=wait, minlength=top)

    def _grow_ranks(self, n: int) -> None:
        extra = n - len(self.calls)
        self.calls = np.concatenate([self.calls, np.zeros(extra, np.int64)])
        self.wait = np.concatenate([self.wait, np.zeros(extra)])
        self.last = np.concatenate([self.last, np.zeros(extra, np.int64)])
        self.cost = np.concatenate([self.cost, np.zeros(extra)])
        self.gaps = np.concatenate([self.gaps, np.zeros((extra, GAP_BINS), np.int64)])
        self.host = np.concatenate([self.host, np.zeros(extra, np.int64)])

    def _merge(self, part: dict[str, np.ndarray], sizes: np.ndarray) -> np.ndarray:
        """Fold the block's per-key aggregates into the open table; finish full keys."""
        keys = part["key"]  # ascending (the block was sorted by key)
        pos = np.searchsorted(self.keys, keys)
        hit = pos < len(self.keys)
        hit[hit] = self.keys[pos[hit]] == keys[hit]
        slots = np.full(len(keys), -1, np.int64)
        slots[hit] = self.rows[pos[hit]]
        new = ~hit
        if new.any():
            slots[new] = self._alloc(int(new.sum()))
        c = self.cols
        old = ~new
        if old.any():
            s = slots[old]
            a_min, a_sec = c["min"][s], c["second"][s]
            b_min, b_sec = part["min"][old], part["second"][old]
            mine = a_min <= b_min
            for f in ("last", "site", "op", "numel"):
                part[f][old] = np.where(mine, c[f][s], part[f][old])
            part["second"][old] = np.where(mine, np.minimum(a_sec, b_min),
                                           np.minimum(b_sec, a_min))
            part["min"][old] = np.minimum(a_min, b_min)
            part["cnt"][old] += c["cnt"][s]
            part["sum"][old] += c["sum"][s]
            part["t_ref"][old] = np.fmax(part["t_ref"][old], c["t_ref"][s])
            part["step"][old] = np.where(mine, c["step"][s], part["step"][old])
        for f, col in part.items():
            c[f][slots] = col
        size = sizes[keys >> _SEQ_BITS]
        full = part["cnt"] >= size
        gone = hit & full
        if gone.any():
            self._unindex(pos[gone])
        add = new & ~full
        if add.any():
            at = np.searchsorted(self.keys, keys[add])
            self.keys = np.insert(self.keys, at, keys[add])
            self.rows = np.insert(self.rows, at, slots[add])
        out = self._finish(slots[full], part, full, size[full])
        if len(self.keys) > self.max_open:
            self._drop_oldest()
        return out

    def _unindex(self, at: np.ndarray) -> None:
        keep = np.ones(len(self.keys), bool)
        keep[at] = False
        self.keys, self.rows = self.keys[keep], self.rows[keep]

    def _alloc(self, n: int) -> np.ndarray:
        if self.nfree < n:
            self._grow_open(n - self.nfree)
        self.nfree -= n
        rows = self.free[self.nfree:self.nfree + n].copy()
        self.cols["born"][rows] = self.born + np.arange(n)
        self.born += n
        return rows

    def _grow_open(self, need: int) -> None:
        have = len(self.cols["key"])
        more = max(need, have, 64)
        for name, dtype in _OPEN_FIELDS:
            self.cols[name] = np.concatenate([self.cols[name], np.zeros(more, dtype)])
        self._give_back(np.arange(have + more - 1, have - 1, -1, dtype=np.int64))

    def _give_back(self, rows: np.ndarray) -> None:
        """Rows back on the free stack (a Python list of them cost ~1 µs a row)."""
        end = self.nfree + len(rows)
        if end > len(self.free):
            self.free = np.concatenate([self.free[:self.nfree],
                                        np.zeros(max(end, 2 * len(self.free)) - self.nfree,
                                                 np.int64)])
        self.free[self.nfree:end] = rows
        self.nfree = end

    def _finish(self, rows: np.ndarray, part: dict[str, np.ndarray], full: np.ndarray,
                n: np.ndarray) -> np.ndarray:
        """Close the full keys (a duplicate record makes a count past the size: dropped)."""
        out = np.zeros(len(rows), ARRIVAL_DTYPE)
        if not len(rows):
            return out
        key = part["key"][full]
        self._give_back(rows)
        exact = part["cnt"][full] == n
        mn, total = part["min"][full], part["sum"][full]
        out["wid"], out["seq"] = key >> _SEQ_BITS, key & ((1 << _SEQ_BITS) - 1)
        out["n"], out["last"], out["transfer"] = n, part["last"][full], mn
        out["gap"] = part["second"][full] - mn
        out["cost"] = total - n * mn
        out["others"] = total - mn
        for f in ("t_ref", "step", "site", "op", "numel"):
            out[f] = part[f][full]
        out = out[exact & np.isfinite(out["t_ref"])]
        self._tally_last(out)
        return out

    def _tally_last(self, out: np.ndarray) -> None:
        if not len(out):
            return
        last = out["last"]
        self.last += np.bincount(last, minlength=len(self.last))
        np.add.at(self.cost, last, out["cost"])  # in order: the sums stay those of one add each
        b = np.clip(np.floor(np.log2(np.maximum(out["gap"], 1e-12) / GAP_FLOOR)) + 1, 0,
                    GAP_BINS - 1).astype(np.int64)
        self.gaps += np.bincount(last * GAP_BINS + b, minlength=self.gaps.size).reshape(
            self.gaps.shape)

    def _drop_oldest(self) -> None:
        """Past ``max_open`` keys (members that never report): drop the oldest eighth."""
        victims = np.argsort(self.cols["born"][self.rows])[:max(1, len(self.rows) // 8)]
        self._give_back(self.rows[victims])
        self._unindex(victims)
        self.dropped += len(victims)

    # -- what the report and the metrics read ---------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Per rank that took part in a checked collective, as collector counters (they add
        up across shards): ``late.<rank>.calls``, ``.wait_us``, ``.last``, ``.cost_us`` and
        the nonzero bins ``.gap<b>`` of its gaps when last (see ``GAP_FLOOR``)."""
        out: dict[str, int] = {}
        for r in np.flatnonzero(self.calls).tolist():
            p = f"late.{r}."
            out[p + "calls"] = int(self.calls[r])
            out[p + "wait_us"] = int(self.wait[r] * 1e6)
            out[p + "last"] = int(self.last[r])
            out[p + "cost_us"] = int(self.cost[r] * 1e6)
            for b in np.flatnonzero(self.gaps[r]).tolist():
                out[f"{p}gap{b}"] = int(self.gaps[r, b])
        return out

