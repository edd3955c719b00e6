"""Collectives inside compiled graphs: the ``_c10d_functional`` ops, at the dispatcher.

Dynamo lowers ``dist.*`` and DTensor's functional collectives to ``torch.ops._c10d_functional``
ops, and the code Inductor generates calls them itself
(``torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '0')``, then ``wait_tensor``):
no Python wrapper is on that path, but the dispatcher is. commcheck registers a kernel for
each op at ``BackendSelect``, a key every call passes on its way to the backend's kernel (it
is in the default include set: any device, inference mode too; torch's own kernel is the
``CompositeExplicitAutograd`` one, which fills the backend keys below). The kernel runs the
one wrapper sequence (:mod:`.wrap`) around a redispatch to the keys below, and records the
call under the functional op's canonical name (:data:`FUNCOL_OPS`): the same records,
fingerprints and verdicts as an eager call. The output is fingerprinted when the graph
waits it (``wait_tensor``), never by forcing a wait.

The redispatch releases the GIL, as torch's own call does: gloo's worker thread takes the
GIL to free tensors while it holds its queue's lock, so a backend kernel called with the
GIL held (``torch.library.get_kernel(...).call_boxed``) deadlocks on that lock.

Nothing changes in the graph: Dynamo and AOTAutograd trace with fake tensors (calls on meta
tensors pass straight through here), so graphs, graph breaks, generated code and numerics
are the unpatched ones, and a graph compiled before ``patch()`` is checked too.
``unpatch()`` destroys the registrations. A call made inside a commcheck wrapper (an eager
functional collective, recorded by :mod:`.funcol`) passes straight through. The call site is
the user's line the collective was traced from (:func:`.callsite.traced`).

Not covered here, so counted as bypassed by the backend's counters (:mod:`.bypass`): the
functional point-to-point ops (``isend``, ``irecv``, ``batch_p2p_ops``), and CUDA-graph
replays, which run no Python (a call met while a CUDA graph is captured is counted
``cuda_graph_capture``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.distributed_c10d as c10d

from ..wire.ops import FUNCOL_OPS
from . import guard
from .funcol import Unwaited, _key
from .install import Installer
from .session import Call, Session
from .wrap import wrap

NAMESPACE = "_c10d_functional"
AFTER = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
KEYS = "__keys__"  # the dispatch key set, in a bound call: passed on to torch's kernel
GROUP = "group_name"
SPECS = {s.name: s for s in FUNCOL_OPS}


@dataclass(frozen=True)
class Kernel:
    """One ``_c10d_functional`` op: the functional spec it is recorded as, and the spec's
    names for the op's positional arguments (the group's last)."""

    op: str
    spec: str
    params: tuple[str, ...]
    out: bool = False  # takes a keyword ``out``: the tensor returned


_REDUCE = ("self", "reduceOp", GROUP)
_GATHER = ("self", "group_size", GROUP)
_SCATTER = ("self", "reduceOp", "group_size", GROUP)
_BCAST = ("self", "src", GROUP)
KERNELS: tuple[Kernel, ...] = (
    Kernel("all_reduce", "all_reduce", _REDUCE),
    Kernel("all_reduce_", "all_reduce", _REDUCE),
    Kernel("all_reduce_coalesced", "all_reduce_coalesced", _REDUCE),
    Kernel("all_reduce_coalesced_", "all_reduce_coalesced", _REDUCE),
    Kernel("all_gather_into_tensor", "all_gather_single", _GATHER),
    Kernel("all_gather_into_tensor_out", "all_gather_single", _GATHER, out=True),
    Kernel("all_gather_into_tensor_coalesced", "all_gather_single_coalesced", _GATHER),
    Kernel("reduce_scatter_tensor", "reduce_scatter_single", _SCATTER),
    Kernel("reduce_scatter_tensor_out", "reduce_scatter_single", _SCATTER, out=True),
    Kernel("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
           ("inputs", "reduceOp", "group_size", GROUP)),
    Kernel("all_to_all_single", "all_to_all_single",
           ("self", "output_split_sizes", "input_split_sizes", GROUP)),
    Kernel("broadcast", "broadcast", _BCAST),
    Kernel("broadcast_", "broadcast", _BCAST),
)


def _group(name: object) -> object:
    """The ProcessGroup a ``group_name`` argument names (a name, or the group itself)."""
    return c10d._resolve_process_group(name) if isinstance(name, str) else name


def _meta(x: object) -> bool:
    """A fake-tensor trace's call (meta tensors), or one with no tensor to check."""
    if isinstance(x, list):
        x = x[0] if x else None
    return not isinstance(x, torch.Tensor) or x.is_meta


def _binder(k: Kernel) -> Callable[[tuple, dict], dict | None]:
    params, n = k.params, len(k.params) + 1

    def bind(args: tuple, kwargs: dict) -> dict | None:
        if len(args) != n or _meta(args[1]):
            return None
        bound = dict(zip(params, args[1:], strict=True))
        bound[KEYS] = args[0]
        bound["group"] = _group(bound[GROUP])
        if k.out:
            bound["out"] = kwargs.get("out")
        return bound

    return bind


def _real(k: Kernel, op: torch._ops.OpOverload) -> Callable:
    """The keys below ours, called as the dispatcher called us, or by the bound names where
    a ``shape`` fault narrowed the input (the wrapper's ``rebind``)."""
    redispatch = op.redispatch

    def real(*args, **kwargs):
        if args:
            return redispatch(args[0] & AFTER, *args[1:], **kwargs)
        out = {"out": kwargs["out"]} if k.out else {}
        return redispatch(kwargs[KEYS] & AFTER, *(kwargs[p] for p in k.params), **out)

    return real


def _tracker(session: Session, unwaited: Unwaited) -> Callable[[Call, object], object]:
    def track(call: Call, result: object) -> object:
        """The wrapper's ``after``: finish the call when the graph waits its result."""
        call.record.t_exit = time.time()
        call.output = result
        outs = result if isinstance(result, list) else [result]
        keys = [_key(t) for t in outs if isinstance(t, torch.Tensor)]
        if keys:
            unwaited.add(keys, call)
        else:
            session.finish(call)
        return result

    return track


def _waiter(op: torch._ops.OpOverload, unwaited: Unwaited) -> Callable:
    redispatch = op.redispatch

    def wait_tensor(keys, tensor):
        out = redispatch(keys & AFTER, tensor)
        unwaited.finish(tensor)
        return out

    return wait_tensor


def _op(name: str) -> torch._ops.OpOverload | None:
    """The op's only overload; None where this torch has no such op."""
    try:
        return getattr(torch.ops._c10d_functional, name).default
    except (AttributeError, RuntimeError):
        return None


def install(session: Session, installer: Installer) -> None:
    """Register commcheck's kernels; the installer's undo destroys them. Where torch will
    not have them, compiled collectives stay counted as bypassed (an error, counted)."""
    try:
        lib = torch.library.Library(NAMESPACE, "IMPL")
    except Exception as e:
        session.fail(e)
        return
    installer.defer(lib._destroy)
    unwaited = Unwaited(session)
    session.on_stop(unwaited.abandon)
    try:
        _register(lib, session, unwaited)
    except Exception as e:
        session.fail(e)


def _register(lib: torch.library.Library, session: Session, unwaited: Unwaited) -> None:
    track = _tracker(session, unwaited)
    for k in KERNELS:
        op = _op(k.op)
        if op is not None:
            lib.impl(k.op, wrap(_real(k, op), session, SPECS[k.spec], bind=_binder(k),
                                after=track, aside=guard.nested_compiling_or_tracing,
                                rebind=True), "BackendSelect", with_keyset=True)
    op = _op("wait_tensor")
    if op is not None:
        lib.impl("wait_tensor", _waiter(op, unwaited), "BackendSelect",
                 with_keyset=True)
