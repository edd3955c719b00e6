"""``_coalescing_manager`` blocks and ``batch_isend_irecv``: wrappers that record nothing
themselves but keep the per-op wrappers correct inside them.

Inside a coalescing block c10d only queues ``all_reduce``/``all_gather_single``/
``reduce_scatter_single`` (and, with a ``device``, every op is coalesced in C++): their
outputs exist when the block's work completes, so the session defers those records to the
end of the block (or to the block's Work for ``async_ops``).

``batch_isend_irecv`` and ``P2POp`` check ``op`` *by identity* against the module's
``isend``/``irecv``. With the wrappers installed, an op captured before ``patch()`` (the
original function) would fail that check, so ``_check_op`` accepts both, and
``batch_isend_irecv`` hands c10d copies of such P2POps that name the wrapper.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch.distributed.distributed_c10d as c10d

from .session import Session


def coalescing_manager(orig: Callable, session: Session) -> Callable:
    @contextlib.contextmanager
    @functools.wraps(orig)
    def _coalescing_manager(group=None, device=None, async_ops: bool = False) -> Iterator:
        pg = None
        try:
            pg = group or c10d._get_default_group()
            session.open_block(pg, device)
        except Exception as e:
            session.fail(e)
        covered = session.tally.enter(pg)
        try:
            with orig(group, device, async_ops) as cm:
                yield cm
        except BaseException:
            if pg is not None:
                session.drop_block(pg)
            raise
        finally:
            session.tally.leave(pg, covered)
        if pg is not None:
            try:
                session.close_block(pg, cm.works if async_ops else None)
            except Exception as e:
                session.fail(e)

    _coalescing_manager.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return _coalescing_manager


def check_op(orig: Callable, same: dict[object, object]) -> Callable:
    """``_check_op`` that treats an original ``isend``/``irecv`` and its wrapper alike."""

    @functools.wraps(orig)
    def _check_op(op) -> None:
        return orig(same.get(op, op))

    return _check_op


def _renamed(p: c10d.P2POp, op: object) -> c10d.P2POp:
    """A copy of ``p`` naming ``op`` (P2POp.__new__ wants arguments: bypass it)."""
    q = object.__new__(type(p))
    q.__dict__.update(p.__dict__)
    q.op = op
    return q


def batch_isend_irecv(orig: Callable, same: dict[object, object],
                      session: Session) -> Callable:
    """Hand c10d P2POps that name the installed wrappers, so its identity checks hold."""

    @functools.wraps(orig)
    def _batch_isend_irecv(p2p_op_list):
        pg = None
        if isinstance(p2p_op_list, list):
            fixed = []
            for p in p2p_op_list:
                op = getattr(p, "op", None)
                if isinstance(p, c10d.P2POp) and op in same:
                    p = _renamed(p, same[op])
                fixed.append(p)
            p2p_op_list = fixed
            if fixed and isinstance(fixed[0], c10d.P2POp):
                pg = fixed[0].group or c10d.GroupMember.WORLD
        covered = session.tally.enter(pg)
        try:
            return orig(p2p_op_list)
        finally:
            session.tally.leave(pg, covered)

    _batch_isend_irecv.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return _batch_isend_irecv
