"""Collectives called as ``ProcessGroup`` methods: ``pg.allreduce([t])``, ``pg.broadcast``...

c10d's own tests and some frameworks call the process group's methods directly instead of
``dist.*``. Those calls pass through Python (pybind methods of
``torch._C._distributed_c10d.ProcessGroup``), so commcheck wraps the methods, with the
same sequence as every wrapper (:func:`.wrap.wrap`):

* the single-tensor forms of ``allreduce``, ``broadcast``, ``reduce``, ``allgather`` and
  ``barrier`` (how ``dist.*`` itself calls them) are recorded under the ``dist`` names
  (``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``barrier``): the same
  collective, the same checks, the same fault-injection names;
* every other collective method, and other forms (several tensors in one call, root
  tensors), runs unchanged and is counted as not checked, reason ``ProcessGroup method``.

``torch.distributed`` calls these methods itself (inside wrapped calls, or at the end of a
``_coalescing_manager`` block whose calls were recorded one by one): calls from its files
step aside, so one user call stays one record (``torch.testing``'s suites are callers like
any other). Calls C++ makes (DDP's reducer, ``_broadcast_coalesced``, functional
collectives) never pass through Python methods; the bypass tally (:mod:`.bypass`) counts
them, as it counts any such call of torch's that no wrapper saw.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from ..native import hot as native_hot
from ..wire.ops import BY_NAME
from . import guard
from .install import Installer
from .session import Session
from .wrap import wrap

REASON = "ProcessGroup method"
# Collective methods only recorded-or-counted; the rest (rank, size, options...) untouched.
COUNTED = ("allreduce_coalesced", "reduce_scatter", "reduce_scatter_single",
           "_reduce_scatter_base", "reduce_scatter_single_coalesced",
           "reduce_scatter_tensor_coalesced", "all_gather_single", "_allgather_base",
           "allgather_coalesced", "all_gather_single_coalesced",
           "allgather_into_tensor_coalesced", "gather", "scatter", "alltoall", "alltoall_base",
           "all_to_all_single", "send", "recv", "recv_anysource", "monitored_barrier")


_TORCH = os.path.dirname(dist.__file__) + os.sep


def _from_torch(depth: int) -> bool:
    """Whether the frame ``depth`` up from the caller is torch.distributed's own code."""
    try:
        return sys._getframe(depth + 1).f_code.co_filename.startswith(_TORCH)
    except ValueError:
        return False


def _wrapper_aside() -> bool:
    """Step aside: a wrapped call runs, Dynamo traces, or torch.distributed is the caller."""
    return guard.nested_or_compiling() or _from_torch(2)  # ← wrap's wrapper ← the caller


def _arg(args: tuple, kwargs: dict, i: int, *names: str) -> object:
    """The ``i``-th argument after ``self``, given by position or by one of ``names``."""
    if len(args) > i + 1:
        return args[i + 1]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return None


def _single(x: object) -> torch.Tensor | None:
    """``x`` as one tensor: a tensor, or a list holding exactly one."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, list) and len(x) == 1 and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _redop(x: object) -> object:
    op = getattr(x, "reduceOp", x)  # AllreduceOptions / ReduceOptions, or the op itself
    op = getattr(op, "op", op)  # a ReduceOp object holds its RedOpType
    return dist.ReduceOp.SUM if op is None else op


def _allreduce(args: tuple, kwargs: dict) -> dict | None:
    t = _single(_arg(args, kwargs, 0, "tensors", "tensor"))
    return None if t is None else {"tensor": t, "op": _redop(_arg(args, kwargs, 1, "opts", "op"))}


def _broadcast(args: tuple, kwargs: dict) -> dict | None:
    first = _arg(args, kwargs, 0, "tensors", "tensor")
    t = _single(first)
    if t is None:
        return None
    second = _arg(args, kwargs, 1, "opts", "root")
    if isinstance(first, torch.Tensor):
        root = second
    else:
        if second is not None and getattr(second, "rootTensor", 0) != 0:
            return None
        root = getattr(second, "rootRank", 0) if second is not None else 0
    return {"tensor": t, "group_src": int(root or 0)} if isinstance(root, int | None) \
        else None


def _reduce(args: tuple, kwargs: dict) -> dict | None:
    first = _arg(args, kwargs, 0, "tensors", "tensor")
    t = _single(first)
    if t is None:
        return None
    if isinstance(first, torch.Tensor):
        root = _arg(args, kwargs, 1, "root")
        op = _arg(args, kwargs, 2, "op")
        if not isinstance(root, int):
            return None
    else:
        opts = _arg(args, kwargs, 1, "opts")
        if opts is not None and getattr(opts, "rootTensor", 0) != 0:
            return None
        root, op = getattr(opts, "rootRank", 0), opts
    return {"tensor": t, "group_dst": int(root), "op": _redop(op)}


def _allgather(args: tuple, kwargs: dict) -> dict | None:
    out = _arg(args, kwargs, 0, "output_tensors")
    inp = _arg(args, kwargs, 1, "input_tensors", "input_tensor")
    if isinstance(inp, torch.Tensor):
        outs = out
    else:
        inp = _single(inp)
        outs = out[0] if isinstance(out, list) and len(out) == 1 else None
    if inp is None or not isinstance(outs, list) or \
            not all(isinstance(o, torch.Tensor) for o in outs):
        return None
    return {"tensor_list": outs, "tensor": inp}


def _barrier(args: tuple, kwargs: dict) -> dict | None:
    opts = _arg(args, kwargs, 0, "opts")
    return None if getattr(opts, "device_ids", None) else {}


RECORDED: dict[str, tuple[str, Callable[[tuple, dict], dict | None]]] = {
    "allreduce": ("all_reduce", _allreduce),
    "broadcast": ("broadcast", _broadcast),
    "reduce": ("reduce", _reduce),
    "allgather": ("all_gather", _allgather),
    "barrier": ("barrier", _barrier),
}


def _counter(session: Session) -> Callable[[tuple, dict], dict | None]:
    """The binder of a method call that is counted, not recorded: not checked, with the
    reason, in the session's own tally (the goodbye and the exit line carry it)."""

    def bind(args: tuple, kwargs: dict) -> dict | None:
        session.skipped(REASON)
        return {"group": args[0]} if args else None

    return bind


def _recording(name: str, orig: Callable, session: Session,
               count: Callable[[tuple, dict], dict | None]) -> Callable:
    op, extract = RECORDED[name]
    spec = BY_NAME[op]

    def bind(args: tuple, kwargs: dict) -> dict | None:
        if not args or not isinstance(args[0], ProcessGroup):
            return None
        bound = extract(args, kwargs)
        if bound is None:
            return None
        bound["group"], bound["async_op"] = args[0], True
        return bound

    recorded = wrap(orig, session, spec, bind=bind, after=session.after)
    counted = wrap(orig, session, None, bind=count)

    nested, local = guard.nested_or_compiling, guard._local

    def method(self, *args, **kwargs):
        # Most calls come from inside dist.*'s wrapper: its flag first, before anything else.
        if getattr(local, "busy", False) or nested() or _from_torch(1):
            return orig(self, *args, **kwargs)
        try:
            known = extract((self, *args), kwargs) is not None
        except Exception:
            known = False
        return (recorded if known else counted)(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = orig.__doc__
    method.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return method


def _gated(orig: Callable, slow: Callable) -> Callable:
    """``slow`` behind the native Gate: a call made inside a wrapped one (dist.all_reduce
    calling ``group.allreduce``: nearly every call) reaches ``orig`` without a Python frame
    of commcheck's; any other call is ``slow``'s to decide. ``slow`` alone without the
    native module."""
    hot = native_hot.module()
    gate = getattr(hot, "Gate", None)
    return slow if gate is None else gate(orig, slow, guard._local)


def install(session: Session, installer: Installer) -> None:
    """Wrap the collective methods of ``ProcessGroup`` (undone with ``installer``)."""
    count = _counter(session)
    for name in RECORDED:
        orig = getattr(ProcessGroup, name, None)
        if orig is not None:
            installer.set(ProcessGroup, name,
                          _gated(orig, _recording(name, orig, session, count)))
    for name in COUNTED:
        orig = getattr(ProcessGroup, name, None)
        if orig is not None:
            installer.set(ProcessGroup, name, _gated(orig, wrap(orig, session, None, bind=count,
                                                                aside=_wrapper_aside)))
