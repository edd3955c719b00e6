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

import functools
from collections.abc import Callable

import torch.distributed.distributed_c10d as c10d

from .session import Session
from .wrap import wrap, wrap_block


def coalescing_manager(orig: Callable, session: Session) -> Callable:
    def begin(group=None, device=None, async_ops: bool = False) -> object:
        pg = group or c10d._get_default_group()
        session.open_block(pg, device)
        return pg

    # c10d puts the block's work in ``cm.works`` only for ``async_ops``: otherwise it waited.
    return wrap_block(orig, session, begin=begin,
                      end=lambda pg, cm: session.close_block(pg, cm.works),
                      drop=session.drop_block)


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


def _named(p2p_op_list: object, same: dict[object, object]) -> object:
    """The list with each P2POp that names an original isend/irecv renamed to its wrapper."""
    if not isinstance(p2p_op_list, list):
        return p2p_op_list
    return [_renamed(p, same[p.op]) if isinstance(p, c10d.P2POp) and p.op in same else p
            for p in p2p_op_list]


def _bind_ops(args: tuple, kwargs: dict) -> dict | None:
    """The group of a P2POp list (its first op's, as c10d takes it)."""
    ops = args[0] if args else kwargs.get("p2p_op_list")
    if not (isinstance(ops, list) and ops and isinstance(ops[0], c10d.P2POp)):
        return None
    return {"group": ops[0].group}


def batch_isend_irecv(orig: Callable, same: dict[object, object],
                      session: Session) -> Callable:
    """Hand c10d P2POps that name the installed wrappers, so its identity checks hold."""

    @functools.wraps(orig)
    def named_batch_isend_irecv(p2p_op_list):
        return orig(_named(p2p_op_list, same))

    wrapper = wrap(named_batch_isend_irecv, session, None, bind=_bind_ops, isolate=False)
    wrapper.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return wrapper
