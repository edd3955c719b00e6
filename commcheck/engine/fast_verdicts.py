"""The fast path's vectorised rules: whole-array checks over rows of a size-class table
(:class:`~.cells.Table`) that say where the exact path would find nothing.

Each rule answers only "clearly clean"; a row any rule does not pass goes to the exact path
(``exact.py``), which stays the only place that says what a finding is:

* desync signatures: members agree on op, dtype, redop, root and counts;
* outputs: one hash algorithm, equal output hashes for replicated ops;
* links: an all_gather's outputs combine its members' inputs in group order, an
  all_to_all's output chunks hash like the input chunks sent to them;
* sums: all_reduce and reduce_scatter results clearly within ``reduction_tolerance``,
  with a margin for the exact path's summation order.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ..wire import F_IN_HASH, F_IN_SUMMARY, F_OUT_HASH, F_OUT_SUMMARY
from .cells import META_DTYPE, Table
from .ids import RED_ALL, RED_NONE, RED_SCATTER, Ids
from .kept import Kept

_LOW64 = (1 << 64) - 1

def _sig_words() -> tuple[list[int], np.ndarray, np.ndarray]:
    """META words holding the desync signature, with the bit masks of what members must
    agree on: op, dtype, redop, root, numel_in, numel_out; for all_to_alls (uneven splits
    let the counts differ, see ops._UNEVEN) op, dtype, redop and root. Splits are not
    compared (they are not agreed on where they may be present)."""
    masks = []
    for fields in (("op", "dtype", "redop", "root", "numel_in", "numel_out"),
                   ("op", "dtype", "redop", "root")):
        mask = np.zeros(META_DTYPE.itemsize, np.uint8)
        for f in fields:
            dtype, off = META_DTYPE.fields[f][:2]
            mask[off:off + dtype.itemsize] = 0xFF
        masks.append(mask.view(np.uint64))
    keep = np.flatnonzero(masks[0])
    return keep.tolist(), masks[0][keep], masks[1][keep]


_SIG_WORDS, _SIG_MASK, _SIG_MASK_UNEVEN = _sig_words()
_EPS = 2.0**-52


class FastVerdicts:
    """The vectorised checks of rows every member entered (signatures) or completed
    (:meth:`verdict`), over the engine's ids and the fast path's kept chunk tables."""

    def __init__(self, ids: Ids, kept: Kept):
        self.ids = ids
        self.kept = kept

    def signatures_differ(self, table: Table, rows: np.ndarray) -> np.ndarray:
        """Rows every member entered: where their desync signatures do not agree."""
        uneven = self.ids.prop("a2a")[table.meta["op"][rows, 0]]
        mask = np.where(uneven[:, None], _SIG_MASK_UNEVEN, _SIG_MASK)[:, None, :]
        sig = table.meta_w[rows][:, :, _SIG_WORDS] & mask
        return ~(sig == sig[:, :1]).all(axis=(1, 2))

    def verdict(self, table: Table, rows: np.ndarray) -> np.ndarray:
        """True where the exact path would find nothing: equal hashes among members that
        hashed their output, every link as sent, and sums clearly within tolerance."""
        if not len(rows):
            return np.zeros(0, bool)
        op = table.meta["op"][rows, 0]
        flags = table.flags[rows]
        clean = self._outputs_agree(table, rows, op, flags)
        self._links_clean(table, rows, op, flags, clean)
        self._sums_clean(table, rows, op, flags, clean)
        return clean

    def _outputs_agree(self, table: Table, rows: np.ndarray, op: np.ndarray,
                       flags: np.ndarray) -> np.ndarray:
        """One hash algorithm (for known ops), and for replicated ops equal output hashes
        among the members that hashed theirs."""
        ids = self.ids
        algo = table.algo[rows]
        clean = (algo == algo[:, :1]).all(axis=1) | ~ids.prop("known")[op]
        repl = ids.prop("replicated")[op]
        if repl.any():
            hashed = (flags & F_OUT_HASH) != 0
            ref = hashed.argmax(axis=1)[:, None]
            h0, h1 = table.obs["out_h0"][rows], table.obs["out_h1"][rows]
            same = (((h0 == np.take_along_axis(h0, ref, axis=1)) &
                     (h1 == np.take_along_axis(h1, ref, axis=1))) | ~hashed).all(axis=1)
            clean &= same | ~repl
        return clean

    def _links_clean(self, table: Table, rows: np.ndarray, op: np.ndarray, flags: np.ndarray,
                     clean: np.ndarray) -> None:
        """Clear ``clean`` for all_gathers and all_to_alls with a link the exact path would
        name."""
        gather = self.ids.prop("gather")[op] & clean
        if gather.any():
            clean[gather] = self._gathered(table, rows[gather], flags[gather])
        a2a = self.ids.prop("a2a")[op] & clean
        if a2a.any():
            clean[a2a] = self._exchanged(table, rows[a2a], flags[a2a])

    def _sums_clean(self, table: Table, rows: np.ndarray, op: np.ndarray, flags: np.ndarray,
                    clean: np.ndarray) -> None:
        """Clear ``clean`` for reductions the vectorised checks do not cover, and for
        reduce_scatters and checked all_reduces not clearly within tolerance."""
        ids = self.ids
        red = ids.prop("reduction")[op]
        clean &= (red == RED_NONE) | (red == RED_ALL) | (red == RED_SCATTER)
        redop = table.meta["redop"][rows, 0]
        scatter = clean & (red == RED_SCATTER)
        if scatter.any():
            clean[scatter] = self._scattered(table, rows[scatter], flags[scatter],
                                             redop[scatter])
        check = clean & (red == RED_ALL) & ids.prop("red_checked")[redop]
        if check.any():
            f = flags[check]
            check[check] = ((f & F_IN_SUMMARY) != 0).all(axis=1) & \
                ((f & F_OUT_SUMMARY) != 0).all(axis=1)
        if check.any():
            clean[check] = self._checksum_ok(table, rows[check], redop[check])

    @staticmethod
    def _gathered(table: Table, rows: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """An all_gather row is clean when every member hashed both sides and every output
        hash is the combination of the members' input hashes in group order: each output
        chunk then is what its sender sent (the exact path's link check passes), and the
        outputs agree. Anything else (one receiver's chunk, or one sender's data to all,
        differs) goes to the exact path with the kept chunks."""
        hashed = ((flags & F_IN_HASH) != 0).all(axis=1) & \
            ((flags & F_OUT_HASH) != 0).all(axis=1)
        clean = np.zeros(len(rows), bool)
        ins = np.stack([table.obs["in_h0"][rows], table.obs["in_h1"][rows]],
                       axis=2).astype("<u8")
        out0, out1 = table.obs["out_h0"][rows, 0], table.obs["out_h1"][rows, 0]
        for i in np.flatnonzero(hashed).tolist():
            h = xxhash.xxh3_128_intdigest(ins[i].tobytes())
            clean[i] = (h & _LOW64) == int(out0[i]) and h >> 64 == int(out1[i])
        return clean

    def _exchanged(self, table: Table, rows: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """An all_to_all row is clean when every output chunk from s on d hashes like the
        input chunk s sent to d, wherever s hashed its input and d its output (the exact
        path's link check). Needs every member's kept chunks (input then output)."""
        n = table.n
        cblk, coff = table.cblk[rows], table.coff[rows]
        clean = (cblk >= 0).all(axis=1)
        h = np.zeros((len(rows), n, 2 * n, 2), np.uint64)
        k = np.arange(2 * n)
        for b in np.unique(cblk[clean]).tolist():
            at = clean[:, None] & (cblk == b)
            kept = self.kept.tables[b]
            pos = coff[at][:, None] + k
            h[at, :, 0], h[at, :, 1] = kept["h0"][pos], kept["h1"][pos]
        sent, got = h[:, :, :n], h[:, :, n:].transpose(0, 2, 1, 3)  # both [row, src, dst]
        checked = ((flags & F_IN_HASH) != 0)[:, :, None] & ((flags & F_OUT_HASH) != 0)[:, None, :]
        return clean & ~((sent != got).any(axis=3) & checked).any(axis=(1, 2))

    def _scattered(self, table: Table, rows: np.ndarray, flags: np.ndarray,
                   redop: np.ndarray) -> np.ndarray:
        """reduce_scatter rows the exact path would pass: its reduction check (each
        member's output sum against the chunk sums sent to it) is skipped for reduce ops
        it does not check or without summaries, else must hold clearly within tolerance,
        with a margin for the exact path's summation order (as in :meth:`_checksum_ok`)."""
        clean = np.ones(len(rows), bool)
        check = self.ids.prop("red_checked")[redop] & \
            ((flags & F_IN_SUMMARY) != 0).all(axis=1) & ((flags & F_OUT_SUMMARY) != 0).all(axis=1)
        if not check.any():
            return clean
        rows, redop = rows[check], redop[check]
        n = table.n
        scale = np.where(self.ids.prop("avg")[redop], 1.0 / n, 1.0)[:, None]
        tol = _tolerance(n, self.ids.prop("unit")[table.meta["dtype"][rows, 0]][:, None],
                         table.meta["numel_out"][rows],
                         table.obs["in_absmax"][rows].sum(axis=1)[:, None])
        clean[check] = _clearly_within(n, tol, table.exp[rows] * scale,
                                       table.exp_abs[rows] * scale,
                                       table.obs["out_sum"][rows]).all(axis=1)
        return clean

    def _checksum_ok(self, table: Table, rows: np.ndarray, redop: np.ndarray) -> np.ndarray:
        """|Σ in_sum − out_sum| within ``reduction_tolerance`` with a margin that covers any
        summation order (the exact path sums in arrival order)."""
        n = table.n
        scale = np.where(self.ids.prop("avg")[redop], 1.0 / n, 1.0)[:, None]
        in_sum = table.obs["in_sum"][rows]
        tol = _tolerance(n, self.ids.prop("unit")[table.meta["dtype"][rows, 0]][:, None],
                         table.meta["numel_out"][rows, :1],
                         table.obs["in_absmax"][rows].sum(axis=1)[:, None])
        return _clearly_within(n, tol, in_sum.sum(axis=1)[:, None] * scale,
                               np.abs(in_sum).sum(axis=1)[:, None] * scale,
                               table.obs["out_sum"][rows]).all(axis=1)



def _tolerance(n: int, unit: np.ndarray, numel: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    """``verdicts.reduction_tolerance`` on arrays (numel 0 counts as 1, as there)."""
    return (n + 20) * unit * np.maximum(numel, 1).astype(np.float64) * absmax + 1e-30


def _clearly_within(n: int, tol: np.ndarray, expected: np.ndarray, spread: np.ndarray,
                    out_sum: np.ndarray) -> np.ndarray:
    """|out_sum − expected| within ``tol`` with a margin for summation order: the exact
    path sums the ``n`` terms (of magnitudes adding up to ``spread``) in arrival order, so
    a clean verdict here holds whatever order it uses. Arrays broadcast."""
    slack = (n + 4) * _EPS * (spread + np.abs(out_sum))
    return np.abs(out_sum - expected) + slack <= tol * (1 - (n + 4) * _EPS)

