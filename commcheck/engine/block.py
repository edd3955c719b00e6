"""A block of records (one or more batches, in arrival order) as engine-global columns.

Built once per :meth:`FastPath.ingest`, read-only afterwards: one memcpy of the records,
batch-local string and group indices mapped to global ids, each record's entry metadata
packed into a ``META_DTYPE`` cell, and the mask of records that are unusual on their own
(they take the exact path). Also what the exact path needs to replay a record.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..wire import PHASE_COMPLETE, REC_DTYPE, SIDE_IN, SIDE_OUT, Batch
from .cells import META_DTYPE, META_ITEM, META_WORDS, OBS_END, OBS_ITEM, OBS_START, SHAPE_DIMS
from .handoff import HUGE_SEQ, Rows
from .ids import RED_SCATTER, Ids
from .model import Key
from .state import RankState

A2A_MAX = 64  # all_to_alls of larger groups stay exact: their check holds n x n chunk pairs
# odd multipliers for the split-size digest (position-aware: swapped sizes differ)
_MIX = (np.arange(1, 2 * A2A_MAX + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | \
    np.uint64(1)


class _GlobalIds(NamedTuple):
    """A block's batch-local tables as engine-global ids. Tables are concatenated batch
    after batch; a ``*_base`` array holds, per record, where its batch's table starts."""

    strings: np.ndarray  # global string ids
    string_base: np.ndarray
    wid: np.ndarray  # per record: the global window of its group
    member: np.ndarray  # per record: its rank's member index in that group
    host: np.ndarray  # per record: the global host id of its batch
    shapes: np.ndarray  # the batches' shape tables (shapes, then split sizes)
    shape_base: np.ndarray
    new_windows: list[int]  # window ids this block created

    def string(self, local: np.ndarray) -> np.ndarray:
        """Global string ids of a column of batch-local string indices."""
        return self.strings[local.astype(np.int64) + self.string_base]


class RecordBlock:
    """One block of records as engine-global columns, plus what the exact path needs."""

    def __init__(self, ids: Ids, items: list[tuple[Batch, RankState]], ticket0: int):
        """``items``: each batch with its rank's state; ``ticket0``: the arrival ticket of
        the block's first record (the others follow in order)."""
        self.ids = ids
        self.batches = [b for b, _ in items]
        counts = np.array([len(b.records) for b in self.batches], np.int64)
        self._join(counts)
        self.states, self.rank_slot = _rank_slots(items, counts)
        global_ids = _to_global(ids, self.batches, self.rec, counts)
        self.new_windows = global_ids.new_windows
        self._key_columns(global_ids, ticket0)
        self.op = global_ids.string(self.rec["op"])
        chunked = self._chunks_left_exact()
        split, digest = self._splits_left_exact(global_ids)
        self.meta, bad_shape = self._packed_meta(global_ids, digest)
        self.unusual = chunked | split | bad_shape | _unusual_alone(self.rec, self.huge)
        # A non-finite t_enter: the whole block takes the exact path (``last`` entries).
        self.all_exact = not bool(np.isfinite(self.t_enter).all())
        self._cell_items(global_ids)
        self._rows: dict[int, Rows] = {}

    # -- building ----------------------------------------------------------------------------

    def _join(self, counts: np.ndarray) -> None:
        """The block's records in one array (one memcpy of their bytes: concatenating
        structured arrays copies field by field, and a structured array's buffer export
        builds its format string every time), and which batch each comes from."""
        self.n = int(counts.sum())
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.batch_of = np.repeat(np.arange(len(self.batches)), counts)
        self.rec = self.batches[0].records if len(self.batches) == 1 else np.concatenate(
            [b.records.view(np.uint8) for b in self.batches]).view(REC_DTYPE)

    def _key_columns(self, global_ids: _GlobalIds, ticket0: int) -> None:
        """Where each record goes: window, member (its cell's column), seq; and when."""
        rec = self.rec
        self.wid, self.member = global_ids.wid, global_ids.member
        # Columns read more than once, copied out of the records' unaligned fields once: a
        # comparison or gather on a field of the packed wire record costs several times
        # what it costs on a contiguous column.
        self.phase = rec["phase"].copy()
        seq = rec["seq"]
        self.huge = seq >= HUGE_SEQ
        self.seq = np.where(self.huge, 0, seq).astype(np.int64)
        self.t_enter = rec["t_enter"].copy()
        self.flags = rec["flags"].copy()
        self.ticket0 = ticket0
        self.ticket = ticket0 + np.arange(self.n, dtype=np.int64)

    def _chunks_left_exact(self) -> np.ndarray:
        """Records with chunks, less those the fast path can check (:meth:`_fast_chunks`)."""
        chunked = self.rec["chunk_n"] != 0
        self.chunk_at: np.ndarray | None = None
        self.chunks: np.ndarray | None = None
        self.scatter: np.ndarray | None = None
        if chunked.any():
            chunked &= ~self._fast_chunks(chunked)
        return chunked

    def _fast_chunks(self, chunked: np.ndarray) -> np.ndarray:
        """Completion records whose chunks are exactly one per member, in group order, on
        each side their op cuts: all_gathers (output chunks; the output hash combines them,
        so one comparison certifies every link), reduce_scatters (input chunks with finite
        sums; ``scatter`` marks them, the fast path adds the sums up per destination) and
        all_to_alls of groups up to ``A2A_MAX`` (input then output chunks; the fast path
        compares the chunk matrices). They are placed on the fast path; their chunks stay
        in ``chunks`` (from ``chunk_at``) in case a row needs the exact path."""
        fast, scatter, a2a, size = self._chunk_candidates(chunked)
        cands = np.flatnonzero(fast)
        if not len(cands):
            return fast
        per_batch = [len(b.chunks) for b in self.batches]
        chunks = np.concatenate([b.chunks for b in self.batches]) if len(per_batch) > 1 \
            else self.batches[0].chunks
        first = np.concatenate([[0], np.cumsum(per_batch)[:-1]]).astype(np.int64)
        at = first[self.batch_of[cands]] + self.rec["chunk_off"][cands].astype(np.int64)
        good = self._chunks_in_group_order(chunks, at, cands, scatter[cands], a2a[cands],
                                           size[cands])
        fast[cands[~good]] = False
        self.chunks = chunks
        self.chunk_at = np.full(self.n, -1, np.int64)
        self.chunk_at[cands[good]] = at[good]
        self.scatter = np.zeros(self.n, bool)
        self.scatter[cands[good]] = scatter[cands[good]]
        return fast

    def _chunk_candidates(self, chunked: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Completions of those ops with as many chunks as the group has members (twice for
        all_to_alls); and per record: reduce_scatter, all_to_all, group size."""
        ids, op = self.ids, self.op
        n_chunks = self.rec["chunk_n"].astype(np.int64)
        size = ids.rank_table()[1][self.wid]
        gather = ids.prop("gather")[op]
        scatter = ids.prop("reduction")[op] == RED_SCATTER
        a2a = ids.prop("a2a")[op] & (size <= A2A_MAX)
        cand = chunked & (self.phase == PHASE_COMPLETE) & (
            ((gather | scatter) & (n_chunks == size)) | (a2a & (n_chunks == 2 * size)))
        return cand, scatter, a2a, size

    def _chunks_in_group_order(self, chunks: np.ndarray, at: np.ndarray, cands: np.ndarray,
                               scatter: np.ndarray, a2a: np.ndarray,
                               size: np.ndarray) -> np.ndarray:
        """Per candidate record (``cands``, its chunks from ``at`` in ``chunks``): is chunk k
        on the side its op cuts, owned by member k % size, with a finite sum?"""
        offs, _, flat = self.ids.rank_table()
        n = self.rec["chunk_n"][cands].astype(np.int64)
        rep = np.repeat(np.arange(len(cands)), n)
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        chunk = at[rep] + k
        member = k % size[rep]
        side = np.where(scatter[rep] | (a2a[rep] & (k < size[rep])), SIDE_IN, SIDE_OUT)
        good = (chunks["side"][chunk] == side) & \
            (chunks["index"][chunk] == flat[offs[self.wid[cands]][rep] + member]) & \
            np.isfinite(chunks["sum"][chunk])
        return np.bincount(rep[~good], minlength=len(cands)) == 0

    def _splits_left_exact(self, global_ids: _GlobalIds) -> tuple[np.ndarray, np.ndarray | None]:
        """Records with split sizes, less those the fast path can take (:meth:`_fast_splits`);
        and the digest of the splits of those it takes."""
        rec = self.rec
        split = (rec["in_splits_n"] != 0) | (rec["out_splits_n"] != 0)
        self.split_at: np.ndarray | None = None
        self.splits: np.ndarray | None = None
        if not split.any():
            return split, None
        fast, digest = self._fast_splits(global_ids, split)
        return split & ~fast, digest

    def _fast_splits(self, global_ids: _GlobalIds, split: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """all_to_all records (entry or completion) of groups up to ``A2A_MAX`` whose split
        sizes name one size per member on both sides: the fast path may take them (their
        members agree on op, dtype, redop and root only, as the exact desync check asks).
        Their splits stay in ``splits`` (in then out, from ``split_at``) for the exact
        path's Metas; returns the mask and a 16-bit digest of each record's splits."""
        rec = self.rec
        size = self.ids.rank_table()[1][self.wid]
        fast = split & self.ids.prop("a2a")[self.op] & (size <= A2A_MAX) & \
            (rec["in_splits_n"] == size) & (rec["out_splits_n"] == size)
        digest = np.zeros(self.n, np.uint16)
        cands = np.flatnonzero(fast)
        if not len(cands):
            return fast, digest
        at = (rec["shape_off"].astype(np.int64) + global_ids.shape_base
              + rec["in_ndim"] + rec["out_ndim"])[cands]
        digest[cands] = _split_digest(global_ids.shapes, at, 2 * size[cands])
        self.splits = global_ids.shapes
        self.split_at = np.full(self.n, -1, np.int64)
        self.split_at[cands] = at
        return fast, digest

    def _packed_meta(self, global_ids: _GlobalIds, digest: np.ndarray | None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Each record's entry metadata as a ``META_DTYPE`` cell (``pad``: the digest of its
        splits); and the records with a shape the cell cannot hold."""
        rec = self.rec
        meta = np.zeros(self.n, META_DTYPE)
        meta["op"] = self.op
        for f in ("dtype", "redop", "callsite"):
            meta[f] = global_ids.string(rec[f])
        meta["host"] = global_ids.host
        src = rec.view(np.uint8).reshape(self.n, REC_DTYPE.itemsize)
        dst = meta.view(np.uint8).reshape(self.n, META_DTYPE.itemsize)
        for to, at, width in _META_FROM_REC:  # byte runs: a field at a time is ~2x slower
            item = f"V{width}"
            dst[:, to:to + width].view(item)[:, 0] = src[:, at:at + width].view(item)[:, 0]
        bad_shape = self._pack_shapes(meta, global_ids)
        if digest is not None:  # entry and completion must agree on them: by digest
            meta["pad"] = digest
        return meta, bad_shape

    def _pack_shapes(self, meta: np.ndarray, global_ids: _GlobalIds) -> np.ndarray:
        """Shapes (their first ``SHAPE_DIMS`` dims) into the cells; returns the records
        with a dim that is negative or over 32 bits."""
        rec, flat = self.rec, global_ids.shapes
        in_nd, out_nd = rec["in_ndim"], rec["out_ndim"]
        bad = np.zeros(self.n, bool)
        dims = int(max(in_nd.max(), out_nd.max())) if self.n else 0
        if not len(flat) or not dims:
            return bad
        base = rec["shape_off"].astype(np.int64) + global_ids.shape_base
        k = np.arange(min(dims, SHAPE_DIMS))
        # No dim (or split size) of the block out of range: no record to flag.
        in_range = int(flat.min()) >= 0 and int(flat.max()) <= 0xFFFFFFFF
        for name, first, ndim in (("in_shape", base, in_nd), ("out_shape", base + in_nd,
                                                             out_nd)):
            got = np.take(flat, first[:, None] + k, mode="clip")
            if int(ndim.min()) < len(k):
                got = np.where(k < ndim[:, None], got, 0)
            if not in_range:
                bad |= ((got < 0) | (got > 0xFFFFFFFF)).any(axis=1)
            meta[name][:, :len(k)] = got
        return bad

    def _cell_items(self, global_ids: _GlobalIds) -> None:
        """Whole cells as single void items: numpy copies them with one memcpy each, where
        byte or word columns go element by element (~8x slower for fancy indexing)."""
        rec_bytes = self.rec.view(np.uint8).reshape(self.n, REC_DTYPE.itemsize)
        self.obs_items = rec_bytes[:, OBS_START:OBS_END].view(OBS_ITEM)[:, 0]
        self.algo = global_ids.string(self.rec["algo"])
        self.meta_words = self.meta.view(np.uint64).reshape(self.n, META_WORDS)
        self.meta_items = self.meta_words.view(META_ITEM)[:, 0]

    # -- reading -----------------------------------------------------------------------------

    def key(self, j: int) -> Key:
        """Record ``j``'s key (seq 0 for a huge seq, as in ``seq``)."""
        w = self.ids.windows[int(self.wid[j])]
        return (w.run, w.name, w.ranks, int(self.seq[j]))

    def splits_of(self, j: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        at = -1 if self.split_at is None else int(self.split_at[j])
        if at < 0:
            return (), ()
        n = len(self.ids.windows[int(self.wid[j])].ranks)
        sizes = self.splits[at:at + 2 * n].tolist()
        return tuple(sizes[:n]), tuple(sizes[n:])

    def rows(self, j: int) -> tuple[Rows, int]:
        """The exact path's view of record ``j``: (its batch as Rows, position there)."""
        b = int(self.batch_of[j])
        rows = self._rows.get(b)
        if rows is None:
            rows = self._rows[b] = Rows(self.batches[b])
        return rows, j - int(self.starts[b])


def _byte_runs(fields: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """(META offset, REC offset, width) of ``fields`` (same type in both), adjacent fields
    that are adjacent in both merged into one run."""
    runs: list[list[int]] = []
    for f in fields:
        dtype, to = META_DTYPE.fields[f][:2]
        assert REC_DTYPE.fields[f][0] == dtype
        at = REC_DTYPE.fields[f][1]
        if runs and runs[-1][0] + runs[-1][2] == to and runs[-1][1] + runs[-1][2] == at:
            runs[-1][2] += dtype.itemsize
        else:
            runs.append([to, at, dtype.itemsize])
    return [(a, b, c) for a, b, c in runs]


# The entry fields a cell takes from the record as they are: 5 runs for 8 fields.
_META_FROM_REC = _byte_runs(("root", "peer", "in_ndim", "out_ndim", "numel_in", "numel_out",
                             "step", "t_enter"))


def _rank_slots(items: list[tuple[Batch, RankState]],
                counts: np.ndarray) -> tuple[list[RankState], np.ndarray]:
    """The block's distinct rank states, and per record the index of its rank's."""
    states: list[RankState] = []
    slot_of: dict[int, int] = {}
    slots = []
    for _, state in items:
        k = slot_of.get(id(state))
        if k is None:
            k = slot_of[id(state)] = len(states)
            states.append(state)
        slots.append(k)
    return states, np.repeat(np.array(slots, np.int64), counts)


def _to_global(ids: Ids, batches: list[Batch], rec: np.ndarray,
               counts: np.ndarray) -> _GlobalIds:
    """Map every batch's string, group and host tables to global ids (a few dict lookups
    per table entry, never per record)."""
    strings, windows, members, shapes, hosts, new = [], [], [], [], [], []
    for b in batches:
        env = b.env
        strings.append(ids.string_ids(env.strings))
        wids, cols, created = ids.window_ids(env.run, env.groups, env.rank)
        windows.append(wids)
        members.append(cols)
        new += created
        shapes.append(b.shapes)
        hosts.append(ids.host_id(env.host))

    def per_record(per_batch: list[int]) -> np.ndarray:
        return np.repeat(np.array(per_batch, np.int64), counts)

    group = rec["group"].astype(np.int64) + per_record(_starts(windows))
    return _GlobalIds(np.concatenate(strings), per_record(_starts(strings)),
                   np.concatenate(windows)[group], np.concatenate(members)[group],
                   per_record(hosts), np.concatenate(shapes) if len(shapes) > 1 else shapes[0],
                   per_record(_starts(shapes)), new)


def _starts(tables: list[np.ndarray]) -> list[int]:
    """Where each table starts in their concatenation."""
    out, at = [], 0
    for t in tables:
        out.append(at)
        at += len(t)
    return out


def _unusual_alone(rec: np.ndarray, huge: np.ndarray) -> np.ndarray:
    """Records the exact path takes whatever their key: more dims than a cell holds, an
    unknown phase, a huge seq, NaN/Inf counts or non-finite summaries."""
    unusual = (rec["in_ndim"] > SHAPE_DIMS) | (rec["out_ndim"] > SHAPE_DIMS) | \
        (rec["phase"] > 1) | huge
    unusual |= (rec["in_nan"] | rec["in_inf"] | rec["out_nan"] | rec["out_inf"]) != 0
    unusual |= ~np.isfinite(rec["in_sum"] + rec["in_absmax"] + rec["out_sum"] +
                            rec["out_absmax"])
    return unusual


def _split_digest(flat: np.ndarray, at: np.ndarray, n: np.ndarray) -> np.ndarray:
    """A 16-bit position-aware digest of each record's ``n`` split sizes from ``at``."""
    rep = np.repeat(np.arange(len(at)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    terms = flat[at[rep] + k].astype(np.uint64) * _MIX[k % len(_MIX)]
    sums = np.zeros(len(at), np.uint64)
    np.add.at(sums, rep, terms)
    return (sums ^ (sums >> np.uint64(16)) ^ (sums >> np.uint64(32))) & 0xFFFF
