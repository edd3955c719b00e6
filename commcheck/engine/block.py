"""A block of records (one or more batches, in arrival order) as engine-global columns.

Built once per :meth:`FastPath.ingest`: one memcpy of the records, batch-local string and
group indices mapped to global ids, each record's entry metadata packed into a
``META_DTYPE`` cell, and the mask of records that are unusual on their own (they take the
exact path). Also what the exact path needs to replay a record, and the hooks it calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..wire import PHASE_COMPLETE, REC_DTYPE, SIDE_IN, SIDE_OUT, Batch
from .cells import META_DTYPE, META_ITEM, META_WORDS, OBS_END, OBS_ITEM, OBS_START, SHAPE_DIMS
from .handoff import HUGE_SEQ, Rows
from .ids import RED_SCATTER
from .model import Meta
from .state import RankState

if TYPE_CHECKING:
    from .fastpath import FastPath
    from .ids import Ids

A2A_MAX = 64  # all_to_alls of larger groups stay exact: their check holds n x n chunk pairs
# odd multipliers for the split-size digest (position-aware: swapped sizes differ)
_MIX = (np.arange(1, 2 * A2A_MAX + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | \
    np.uint64(1)


class Block:
    """One block of records as engine-global columns, plus what the exact path needs."""

    def __init__(self, fp: FastPath, items: list[tuple[Batch, RankState]]):
        self.fp = fp
        ids = fp.ids
        self.batches = [b for b, _ in items]
        counts = np.array([len(b.records) for b in self.batches], np.int64)
        self.n = n = int(counts.sum())
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        bidx = np.repeat(np.arange(len(items)), counts)
        # One memcpy: concatenating structured arrays copies field by field.
        rec = self.batches[0].records if len(items) == 1 else np.frombuffer(
            b"".join([b.records.data for b in self.batches]), REC_DTYPE)
        sids, wids, cols, shapes = [], [], [], []
        soff, goff, shoff = [], [], []
        hosts, slots = [], []
        states: list[RankState] = []
        slot_of: dict[int, int] = {}
        ns = ng = nsh = 0
        new: list[int] = []
        for b, state in items:
            env = b.env
            soff.append(ns)
            goff.append(ng)
            shoff.append(nsh)
            s = ids.string_ids(env.strings)
            w, cl, created = ids.window_ids(env.run, env.groups, env.rank)
            new += created
            sids.append(s)
            wids.append(w)
            cols.append(cl)
            shapes.append(b.shapes)
            ns, ng, nsh = ns + len(s), ng + len(w), nsh + len(b.shapes)
            hosts.append(ids.host_id(env.host))
            k = slot_of.get(id(state))
            if k is None:
                k = slot_of[id(state)] = len(states)
                states.append(state)
            slots.append(k)
        if new:
            fp._new_windows(new)
        self.states = states
        self.rank_slot = np.repeat(np.array(slots, np.int64), counts)
        sg = np.concatenate(sids)
        so = np.repeat(np.array(soff, np.int64), counts)
        go = np.repeat(np.array(goff, np.int64), counts)
        g = rec["group"].astype(np.int64) + go
        self.wid = np.concatenate(wids)[g]
        self.col = np.concatenate(cols)[g]
        self.phase = rec["phase"]
        seq = rec["seq"]
        self.huge = seq >= HUGE_SEQ
        self.seq = np.where(self.huge, 0, seq).astype(np.int64)
        self.t_enter = rec["t_enter"]
        self.ticket0 = fp.eng.next_tickets(n)
        self.ticket = self.ticket0 + np.arange(n, dtype=np.int64)
        self.bidx, self.rec, self.sg, self.so = bidx, rec, sg, so
        op = sg[rec["op"].astype(np.int64) + so]
        flat = np.concatenate(shapes) if len(shapes) > 1 else shapes[0]
        chunked = rec["chunk_n"] != 0
        self.chunk_base: np.ndarray | None = None
        self.chunk_table: np.ndarray | None = None
        self.kept_ids: dict[str, int] = {}  # the fast path's ids of tables cells point into
        self.scatter: np.ndarray | None = None
        if chunked.any():
            chunked &= ~self._gathers(ids, rec, op, chunked)
        split = (rec["in_splits_n"] != 0) | (rec["out_splits_n"] != 0)
        self.split_at: np.ndarray | None = None
        self.split_table: np.ndarray | None = None
        digest = None
        if split.any():
            fast, digest = self._uneven(ids, rec, op, split, flat, shoff, counts)
            split &= ~fast
        unusual = chunked | split | (rec["in_ndim"] > SHAPE_DIMS) | \
            (rec["out_ndim"] > SHAPE_DIMS) | (self.phase > 1) | self.huge
        unusual |= (rec["in_nan"] | rec["in_inf"] | rec["out_nan"] | rec["out_inf"]) != 0
        unusual |= ~np.isfinite(rec["in_sum"] + rec["in_absmax"] + rec["out_sum"] +
                                rec["out_absmax"])
        self.all_slow = not bool(np.isfinite(self.t_enter).all())
        meta = np.zeros(n, META_DTYPE)
        meta["op"] = op
        for f in ("dtype", "redop", "callsite"):
            meta[f] = sg[rec[f].astype(np.int64) + so]
        meta["host"] = np.repeat(np.array(hosts, np.int64), counts)
        for f in ("root", "peer", "in_ndim", "out_ndim", "numel_in", "numel_out", "step",
                  "t_enter"):
            meta[f] = rec[f]
        in_nd, out_nd = rec["in_ndim"], rec["out_ndim"]
        dims = int(max(in_nd.max(), out_nd.max())) if n else 0
        if len(flat) and dims:
            base = rec["shape_off"].astype(np.int64) + np.repeat(np.array(shoff), counts)
            k = np.arange(min(dims, SHAPE_DIMS))
            for name, first, nd in (("in_shape", base, in_nd), ("out_shape", base + in_nd,
                                                                 out_nd)):
                idx = np.minimum(first[:, None] + k, len(flat) - 1)
                got = np.where(k < nd[:, None], flat[idx], 0)
                unusual |= ((got < 0) | (got > 0xFFFFFFFF)).any(axis=1)
                meta[name][:, :len(k)] = got
        self.rec_bytes = rec.view(np.uint8).reshape(n, REC_DTYPE.itemsize)
        # Whole cells as single void items: numpy copies them with one memcpy each, where
        # byte or word columns go element by element (~8x slower for fancy indexing).
        self.obs_items = self.rec_bytes[:, OBS_START:OBS_END].view(OBS_ITEM)[:, 0]
        self.algo = sg[rec["algo"].astype(np.int64) + so]
        if digest is not None:  # entry and completion must agree on them: by digest
            meta["pad"] = digest
        self.meta = meta
        self.meta_words = meta.view(np.uint64).reshape(n, META_WORDS)
        self.meta_items = self.meta_words.view(META_ITEM)[:, 0]
        self.slow = unusual | self.all_slow
        self.late = np.zeros(n, bool)
        self.val = self.pos = np.zeros(0, np.int64)
        self.entering: list[np.ndarray] = []
        self.slow_last: dict[int, tuple[float, int, Callable[[], tuple[str, Meta]]]] = {}
        self._rows: dict[int, object] = {}

    def _gathers(self, ids: Ids, rec: np.ndarray, op: np.ndarray,
                 chunked: np.ndarray) -> np.ndarray:
        """Completion records whose chunks are exactly one per member, in group order, on
        each side their op cuts: all_gathers (output chunks; the output hash combines them,
        so one comparison certifies every link), reduce_scatters (input chunks with finite
        sums; ``scatter`` marks them, the fast path adds the sums up per destination) and
        all_to_alls of groups up to ``A2A_MAX`` (input then output chunks; the fast path
        compares the chunk matrices). They are placed on the fast path; their chunks stay
        in ``chunk_table`` (from ``chunk_base``) in case a row needs the exact path."""
        offs, sizes, flat = ids.rank_table()
        n_j = rec["chunk_n"].astype(np.int64)
        size = sizes[self.wid]
        gather = ids.prop("gather")[op]
        scatter = ids.prop("reduction")[op] == RED_SCATTER
        a2a = ids.prop("a2a")[op] & (size <= A2A_MAX)
        cand = chunked & (self.phase == PHASE_COMPLETE) & (
            ((gather | scatter) & (n_j == size)) | (a2a & (n_j == 2 * size)))
        e = np.flatnonzero(cand)
        if not len(e):
            return cand
        per_batch = [len(b.chunks) for b in self.batches]
        table = np.concatenate([b.chunks for b in self.batches]) if len(per_batch) > 1 \
            else self.batches[0].chunks
        first = np.concatenate([[0], np.cumsum(per_batch)[:-1]]).astype(np.int64)
        base = first[self.bidx[e]] + rec["chunk_off"][e].astype(np.int64)
        n = n_j[e]
        rep = np.repeat(np.arange(len(e)), n)
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        at = base[rep] + k
        member = k % size[e][rep]
        side = np.where(scatter[e][rep] | (a2a[e][rep] & (k < size[e][rep])), SIDE_IN,
                        SIDE_OUT)
        good = (table["side"][at] == side) & \
            (table["index"][at] == flat[offs[self.wid[e]][rep] + member]) & \
            np.isfinite(table["sum"][at])
        bad = np.bincount(rep[~good], minlength=len(e)) > 0
        cand[e[bad]] = False
        self.chunk_table = table
        self.chunk_base = np.full(len(rec), -1, np.int64)
        self.chunk_base[e[~bad]] = base[~bad]
        self.scatter = np.zeros(len(rec), bool)
        self.scatter[e[~bad]] = scatter[e[~bad]]
        return cand

    def _uneven(self, ids: Ids, rec: np.ndarray, op: np.ndarray, split: np.ndarray,
                flat: np.ndarray, shoff: list[int],
                counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """all_to_all records (entry or completion) of groups up to ``A2A_MAX`` whose split
        sizes name one size per member on both sides: the fast path may take them (their
        members agree on op, dtype, redop and root only, as the exact desync check asks).
        Their splits stay in ``split_table`` (in then out, from ``split_at``) for the exact
        path's Metas; returns the mask and a 16-bit digest of each record's splits."""
        size = ids.rank_table()[1][self.wid]
        cand = split & ids.prop("a2a")[op] & (size <= A2A_MAX) & \
            (rec["in_splits_n"] == size) & (rec["out_splits_n"] == size)
        digest = np.zeros(len(rec), np.uint16)
        e = np.flatnonzero(cand)
        if not len(e):
            return cand, digest
        at = (rec["shape_off"].astype(np.int64) + np.repeat(np.array(shoff), counts)
              + rec["in_ndim"] + rec["out_ndim"])[e]
        n = 2 * size[e]
        rep = np.repeat(np.arange(len(e)), n)
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        terms = flat[at[rep] + k].astype(np.uint64) * _MIX[k % len(_MIX)]
        sums = np.zeros(len(e), np.uint64)
        np.add.at(sums, rep, terms)
        digest[e] = (sums ^ (sums >> np.uint64(16)) ^ (sums >> np.uint64(32))) & 0xFFFF
        self.split_table = flat
        self.split_at = np.full(len(rec), -1, np.int64)
        self.split_at[e] = at
        return cand, digest

    def splits_of(self, j: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        at = -1 if self.split_at is None else int(self.split_at[j])
        if at < 0:
            return (), ()
        n = len(self.fp.ids.windows[int(self.wid[j])].ranks)
        sizes = self.split_table[at:at + 2 * n].tolist()
        return tuple(sizes[:n]), tuple(sizes[n:])

    def rows(self, j: int) -> tuple[object, int]:
        """The exact path's view of record ``j``: (per-batch Python columns, position)."""
        b = int(self.bidx[j])
        rows = self._rows.get(b)
        if rows is None:
            rows = self._rows[b] = Rows(self.batches[b])
        return rows, j - int(self.starts[b])

    def key_open(self, j: int) -> bool:
        w = self.fp.ids.windows[int(self.wid[j])]
        return (w.run, w.name, w.ranks, int(self.seq[j])) in self.fp.eng.open

    def on_enter(self, rank: int, gname: str, granks: tuple[int, ...], seq: int, meta: Meta,
                 ticket: int) -> None:
        """The exact path entered a member: a candidate for that rank's ``last``."""
        from .model import group_label

        if self.all_slow:
            self.fp.eng.set_last(rank, gname, granks, seq, meta)
            return
        j = ticket - self.ticket0
        k = int(self.rank_slot[j])
        cur = self.slow_last.get(k)
        if cur is None or (meta.t_enter, j) > (cur[0], cur[1]):
            self.slow_last[k] = (meta.t_enter, j, Known(
                (f"{group_label(gname, granks)} seq {seq}", meta)))

    def last_maker(self, j: int) -> Callable[[], tuple[str, Meta]]:
        """Builds (label, Meta) of record ``j`` as the exact path would have stored it; keeps
        a copy of the one row, not the block."""
        rank = self.batches[int(self.bidx[j])].env.rank
        win, seq = self.fp.ids.windows[int(self.wid[j])], int(self.seq[j])
        # a plain copy: structured ones go field by field
        return LastEntry(self.fp.ids, f"{win.label} seq {seq}", self.meta_words[j].copy(), rank,
                         self.splits_of(j))


class LastEntry:
    """A rank's last entered collective as (label, Meta), built when a hang report needs
    it; a class rather than a closure so that the engine's snapshot can pickle it."""

    __slots__ = ("ids", "label", "words", "rank", "splits")

    def __init__(self, ids: Ids, label: str, words: np.ndarray, rank: int,
                 splits: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())):
        self.ids, self.label, self.words, self.rank = ids, label, words, rank
        self.splits = splits

    def __call__(self) -> tuple[str, Meta]:
        meta = meta_list(self.ids, self.words.view(META_DTYPE))[0]
        return self.label, meta._replace(rank=self.rank, in_splits=self.splits[0],
                                         out_splits=self.splits[1])

    def __getstate__(self) -> tuple:
        return self.ids, self.label, self.words, self.rank, self.splits

    def __setstate__(self, state: tuple) -> None:
        self.ids, self.label, self.words, self.rank, self.splits = state


class Known:
    """A last entry built already (by the exact path), in :class:`LastEntry`'s shape."""

    __slots__ = ("value",)

    def __init__(self, value: tuple[str, Meta]):
        self.value = value

    def __call__(self) -> tuple[str, Meta]:
        return self.value

    def __getstate__(self) -> tuple:
        return self.value

    def __setstate__(self, state: tuple) -> None:
        self.value = state


def meta_list(ids: Ids, m: np.ndarray) -> list[Meta]:
    """The Metas of packed ``META_DTYPE`` cells (ids resolved to strings)."""
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
