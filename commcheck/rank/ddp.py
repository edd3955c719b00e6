"""DistributedDataParallel: every gradient bucket recorded through one comm hook per model.

DDP's reducer all-reduces buckets in C++ and never calls the Python API; only a comm hook
sees them. ``patch()`` wraps ``DistributedDataParallel.__init__``: every model built after
it gets commcheck's hook (``COMMCHECK_DDP=0``: only models passed to :func:`watch`). The C++
reducer takes one hook per model, so commcheck's hook is a :class:`Slot`: DDP's default
numerics (torch's ``allreduce_hook``: divide by the group size, SUM all-reduce; the bucket
recorded as ``ddp_allreduce``, reduction check) until the user registers a hook, which then
takes the slot after torch's own checks. A Python hook is wrapped and recorded as
``ddp_bucket`` (its result must agree across replicas; compressing or low-rank hooks are
not sums); the collectives its body issues belong to the bucket and are not recorded again,
so one real collective is one verified collective. A built-in hook becomes torch's Python
equivalent (same numerics). Whatever torch rejects (a hook that is not callable, a second
hook, a result that is not a Future) reaches torch unchanged and fails as it would.

The slot is registered in C++ where it can be (:mod:`commcheck.native.ddphook`): the
default buckets are then recorded without Python but one call per bucket
(:meth:`Slot.begin`, the record's key), and every other bucket (a user's hook in the slot,
CUDA) goes to :func:`_dispatch` as before. A Python comm hook costs the step far more than
its own work does (docs/decisions.md, issue 13).

With ``find_unused_parameters`` the reducer all-reduces its used-parameter map after the
last bucket, in C++: recorded as ``ddp_used_map``, read back when the backward pass ended
(the reducer has waited for it by then). The module buffers DDP broadcasts around the
forward pass are recorded as ``ddp_buffers`` (they must agree after it). Construction and
bucket rebuild run in C++ on tensors commcheck never sees: counted as DDP's own (bypass.py).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..native import ddphook
from ..native import hot as native_hot
from ..wire.ops import BY_NAME
from . import guard
from .callsite import callsite
from .groups import Group
from .install import Installer, binder
from .session import Call, Session
from .wrap import wrap

DEFAULT = BY_NAME["ddp_allreduce"]
USER = BY_NAME["ddp_bucket"]
USED_MAP = BY_NAME["ddp_used_map"]
BUFFERS = BY_NAME["ddp_buffers"]
_SLOT = "_commcheck_slot"
_MARK = "_commcheck_watched"  # a user hook was wrapped at registration (model has no slot)
REGIONS = ("_pre_forward", "_post_forward")  # regions of DDP's own traffic (_Outside)
_BUILTIN = "_commcheck_builtin"  # a built-in hook went to C++ unwatched: no slot possible
_engine = torch.autograd.Variable._execution_engine


def _finish_on(session: Session) -> Callable[[Call, object], object]:
    """The hooks' ``after``: fingerprint the bucket's result when the future completes; DDP
    gets the same value. A result that is not a future goes back to torch as it is."""

    def after(call: Call, fut: object) -> object:
        if not isinstance(fut, torch._C.Future):
            session.not_checked += 1
            return fut

        def done(f: torch.futures.Future):
            value = f.value()
            try:
                call.output = value[0] if isinstance(value, list) else value
                session.finish(call)
            except Exception as e:
                session.fail(e)
            return value

        return fut.then(done)

    return after


def _allreduce_bucket(tensor: torch.Tensor, group: dist.ProcessGroup,
                      delayed: bool) -> torch.futures.Future:
    """torch's ``allreduce_hook`` after its division: SUM all-reduce, a future of the bucket."""
    if delayed:
        dist.all_reduce(tensor, group=group)
        fut = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _bind_bucket(args: tuple, kwargs: dict) -> dict:
    tensor, group, _ = args
    return {"tensor": tensor, "group": group, "op": dist.ReduceOp.SUM}


class _Installed:
    """The session whose wrappers are installed (the installer puts None back)."""

    session: Session | None = None


def _gone(session: Session) -> Callable[[], bool]:
    """A hook outlives ``unpatch()`` on the models it was given: from then on it only runs."""
    return lambda: _Installed.session is not session


def default_hook(session: Session) -> Callable:
    reduce = wrap(_allreduce_bucket, session, DEFAULT, bind=_bind_bucket,
                  after=_finish_on(session), aside=_gone(session))

    def commcheck_allreduce_hook(state, bucket):
        group = state if state is not None else dist.group.WORLD
        # The Python reducer (compiled autograd) passes (grad, param), reduced in place.
        delayed = isinstance(bucket, tuple)
        buffer = bucket[0] if delayed else bucket.buffer()
        buffer.div_(group.size())
        return reduce(buffer, group, delayed)

    return commcheck_allreduce_hook


def _bind_user_bucket(args: tuple, kwargs: dict) -> dict | None:
    state, bucket = args
    group = getattr(state, "process_group", state)
    if not isinstance(group, dist.ProcessGroup):
        group = None
    return {"tensor": bucket.buffer(), "group": group}


# A bucket reduced by one of torch's averaging hooks, recorded as ``ddp_bucket`` with the
# bucket's sum before the hook (its input) and the result's after (its output): the
# reduction op names the hook's numerics (wire/ops.py, HOOK_REDOPS) so a tie at two ranks is
# settled by the inputs (docs/report-status.md, part 4).
MEAN_HOOK = dataclasses.replace(USER, input="tensor", reduce_arg="op", hash_input=False,
                                summarize_output=True)


def hook_numerics(hook: Callable) -> str | None:
    """The reduction op ``hook`` computes, as records name it (``HOOK_REDOPS``): torch's
    ``allreduce_hook`` (the mean), ``fp16_compress_hook``/``bf16_compress_hook`` and the
    same compressions wrapped around ``allreduce_hook`` (the mean through fp16/bf16); None
    for any other hook (PowerSGD, a user's own: only its result is known to agree)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d

    known = {d.allreduce_hook: "AVG", d.fp16_compress_hook: "AVG_FP16",
             d.bf16_compress_hook: "AVG_BF16"}
    found = known.get(hook)
    if found is not None:
        return found
    code = getattr(hook, "__code__", None)
    cells = getattr(hook, "__closure__", None) or ()
    wrapped = {"fp16_compress_wrapper_hook": "AVG_FP16", "bf16_compress_wrapper_hook":
               "AVG_BF16"}.get(getattr(code, "co_name", ""))
    if wrapped is None or getattr(hook, "__module__", "") != d.__name__:
        return None
    inner = dict(zip(code.co_freevars, cells, strict=False)).get("hook")
    try:
        return wrapped if inner is not None and inner.cell_contents is d.allreduce_hook \
            else None
    except ValueError:  # an empty cell
        return None


def _bind_mean_bucket(redop: str) -> Callable[[tuple, dict], dict | None]:
    def bind(args: tuple, kwargs: dict) -> dict | None:
        bound = _bind_user_bucket(args, kwargs)
        if bound is not None:
            bound["op"] = redop
        return bound

    return bind


def wrap_user_hook(session: Session, hook: Callable) -> Callable:
    """``hook`` recorded as ``ddp_bucket``, the collectives of its body covered by the bucket;
    with its input's sum and its output's for torch's averaging hooks (:func:`hook_numerics`).

    The Python reducer's (grad, param) pairs are not buckets: there the collectives the hook
    calls are recorded as themselves."""
    redop = None
    try:
        redop = hook_numerics(hook)
    except Exception as e:  # recorded as any hook
        session.fail(e)
    spec, bind = (USER, _bind_user_bucket) if redop is None else \
        (MEAN_HOOK, _bind_mean_bucket(redop))
    bucketed = wrap(hook, session, spec, bind=bind, after=_finish_on(session),
                    aside=_gone(session))

    @functools.wraps(hook)
    def hooked(state, bucket):
        if isinstance(bucket, tuple):
            return hook(state, bucket)
        return bucketed(state, bucket)

    hooked.__commcheck_original__ = hook  # type: ignore[attr-defined]
    return hooked


class Slot:
    """The one hook the reducer of a watched model calls per bucket: commcheck's default
    until the user registers one (:func:`_dispatch`)."""

    def __init__(self, session: Session, model: DistributedDataParallel, default: Callable):
        self.session = session
        self.group = model.process_group
        self.hook, self.state = default, model.process_group
        self.default = default
        self.user = False  # a hook of the user's (or a built-in) holds the slot
        self.used_map = bool(model.find_unused_parameters) and not model.static_graph
        self.used: torch.Tensor | None = None  # the reducer's map, taken after each forward
        self.gone = _gone(session)
        self.native: object | None = None  # the C++ hook's switch, where it holds the reducer
        self.checked: Group | None = None  # the group its records are keyed by
        self._ring: tuple[object, object] = (None, None)  # (ring writer, its C handle)

    def take(self, state: object, hook: Callable) -> None:
        self.hook, self.state, self.user = hook, state, True
        if self.native is not None and hook is not self.default:
            self.native.native = False  # the user's hook runs in Python, as without C++

    def begin(self) -> tuple | None:
        """Called by the C++ hook per bucket (GIL held): the record's key, (ring handle,
        seq, step, call site), taken as :meth:`Session.before` takes it; None: run the
        bucket unrecorded (after ``unpatch()``, or with no ring)."""
        session = self.session
        try:
            if self.gone() or (session.ring is None and not session.start()):
                return None
            writer = session.ring
            ring = self._ring[1] if self._ring[0] is writer else None
            if ring is None:
                ring = writer.native_handle()
                if ring is None:  # a ring the C path cannot write: Python from now on
                    self.native.native = False  # type: ignore[union-attr]
                    session.skipped("ddp_native_ring")
                    return None
                self._ring = (writer, ring)
            if session.injector is not None and session.injector.faults:
                session.injector.count(DEFAULT.name)  # its exit summary counts every op
            session.tally.add_covered(self.group, 1)
            return (ring, self.checked.take_seq(), session.step,  # type: ignore[union-attr]
                    callsite(1) if session.cfg.callsite else "")
        except Exception as e:
            session.fail(e)
            return None

    def expect_used_map(self) -> None:
        """The reducer all-reduces its used-parameter map right after this (the last)
        bucket: record it now, finish it when the backward pass ended. (The reducer holds
        its lock while it calls the hook: its map was taken after the forward pass.)"""
        if self.used is None or self.gone():
            return
        session = self.session
        call = session.before(USED_MAP, {"tensor": self.used, "group": self.group})
        if not isinstance(call, Call):
            return
        session.tally.add_covered(self.group, 1)

        def finish() -> None:
            try:
                session.finish(call)
            except Exception as e:
                session.fail(e)

        def after_reducer() -> None:
            # Queued from the reducer's hook, this runs before the reducer's own end-of-
            # backward callback; queueing again runs after it, once the map was reduced.
            try:
                _engine.queue_callback(finish)
            except Exception as e:
                session.fail(e)

        _engine.queue_callback(after_reducer)


def _dispatch(slot: Slot, bucket: object) -> object:
    result = slot.hook(slot.state, bucket)
    if slot.used_map and slot.used is not None and not isinstance(bucket, tuple):
        try:
            if bucket.is_last():
                slot.expect_used_map()
        except Exception as e:
            slot.session.fail(e)
    return result


def attach(session: Session, model: DistributedDataParallel) -> bool:
    """Give ``model``'s reducer commcheck's hook; False (warned) where it cannot be done."""
    if getattr(model, _SLOT, None) is not None or getattr(model, _MARK, False):
        return True
    if model._comm_hooks or getattr(model, _BUILTIN, False):
        warnings.warn("commcheck.watch: this DDP model got its comm hook before commcheck "
                      "could wrap it (registered before commcheck.patch(), or a built-in hook "
                      "with COMMCHECK_DDP=0); its buckets stay unchecked and are counted as "
                      "bypassed. Call commcheck.patch() before building the model.",
                      stacklevel=4)
        return False
    return _give_slot(session, model)


def _give_slot(session: Session, model: DistributedDataParallel) -> bool:
    if not hasattr(model, "reducer"):
        return True  # every parameter's all-reduce is delayed: DDP calls dist.all_reduce
    slot = Slot(session, model, default_hook(session))
    if not _native(session, model, slot):
        dist._register_comm_hook(model.reducer, slot, _dispatch)
    setattr(model, _SLOT, slot)
    return True


def _native(session: Session, model: DistributedDataParallel, slot: Slot) -> bool:
    """Give the reducer commcheck's C++ hook (:mod:`commcheck.native.ddphook`), which
    records the default buckets natively and hands every other bucket to ``_dispatch``;
    False where it does not apply: the used-parameter map is recorded after the last bucket
    (Python), faults are injected into DDP buckets (Python), no ring to write from C, or
    the extension is unavailable (logged once)."""
    if not ddphook.enabled() or slot.used_map or \
            any(f.op == DEFAULT.name for f in session.faults):
        return False
    try:
        group = session.groups.resolve(model.process_group)
        if group is None or (session.ring is None and not session.start()):
            return False
        ring = session.ring.native_handle()
        if ring is None:
            return False
        mod = ddphook.module()
        if mod is None:
            return False
        cfg = session.cfg
        slot.checked, slot._ring = group, (session.ring, ring)
        api = native_hot.module()._C_API  # type: ignore[union-attr]
        slot.native = mod.install(
            model.reducer, model.process_group, slot, _dispatch, slot.begin, api,
            group.name, list(group.ranks),
            hash_in=cfg.hash and (DEFAULT.hash_input or cfg.hash_reduce_inputs),
            summary_in=cfg.summary, hash_out=cfg.hash,
            summary_out=cfg.summary and DEFAULT.summarize_output)
        session.on_stop(_errors_of(session, slot.native))
        return True
    except Exception as e:
        session.fail(e)
        return False


def _errors_of(session: Session, control: object) -> Callable[[], None]:
    """At stop, the C++ hook's internal errors join the session's count (logged once)."""

    def fold() -> None:
        n = control.errors  # type: ignore[attr-defined]
        if n:
            session.fail(RuntimeError(f"native DDP hook: {control.last_error}"))  # type: ignore
            session.errors += n - 1

    return fold


def watch(session: Session, model: object, hook: Callable | None = None,
          state: object = None) -> bool:
    """Record ``model``'s buckets (with ``hook``, registered as the user's); False (with a
    warning) if impossible. Harmless on a model already watched."""
    if not isinstance(model, DistributedDataParallel):
        warnings.warn(f"commcheck.watch: {type(model).__name__} is not DistributedDataParallel;"
                      f" nothing to watch", stacklevel=3)
        return False
    if hook is not None:
        if getattr(model, _SLOT, None) is None and not getattr(model, _MARK, False) and \
                (model._comm_hooks or getattr(model, _BUILTIN, False)):
            return attach(session, model)  # warns: the earlier hook cannot be replaced
        model.register_comm_hook(state, hook)
        return True
    return attach(session, model)


class _Outside:
    """DDP's method ``name`` as a region (:func:`_own_region`), and as Dynamo must meet it:
    ``torch._dynamo.disable``d (not recursive, so the method inside is compiled as before).

    Under ``torch.compile`` a region that Dynamo traced would skip its mark at run time
    (Dynamo folds ``guard.compiling()`` to true in the frame it compiles), and the bucket
    rebuild's broadcasts were counted as unexplained bypasses. Disabled, the region is one
    graph break where DDP's forward calls it, in place of the one torch's own
    ``_pre_forward`` makes (an untraceable ``Logger`` call): graph-break counts stay equal.
    The disabled function is made once torch._dynamo is loaded (building a DDP model loads
    it), never by importing it: that would cost every job's ``patch()`` seconds.

    Under the Python reducer (compiled autograd) DDP's forward is traced whole and the
    method issues no own traffic: such a model gets torch's method as its own attribute,
    traced as unpatched (a disabled region there would add graph breaks)."""

    def __init__(self, name: str, region: Callable) -> None:
        self.name, self.region = name, region
        self.fn: Callable | None = None

    def ready(self, model: DistributedDataParallel | None = None) -> None:
        if model is not None and getattr(model, "_use_python_reducer", False):
            model.__dict__[self.name] = types.MethodType(self.region.__wrapped__, model)
        if self.fn is not None or "torch._dynamo" not in sys.modules:
            return
        self.fn = torch._dynamo.disable(self.region, recursive=False)
        if vars(DistributedDataParallel).get(self.name) is self.region:  # still patched
            setattr(DistributedDataParallel, self.name, self.fn)


def _own_region(session: Session, method: Callable) -> Callable:
    """``method`` of DDP whose unseen collectives are DDP's own (bucket rebuild, buffers);
    see :class:`_Outside` for ``torch.compile``."""
    tally = session.tally

    @functools.wraps(method)
    def region(self, *args, **kwargs):
        if guard.compiling():  # traced: only before torch._dynamo was loaded (_Outside)
            return method(self, *args, **kwargs)
        pg = getattr(self, "process_group", None)
        mark = tally.mark(pg) if pg is not None else None
        try:
            return method(self, *args, **kwargs)
        finally:
            tally.own(pg, mark)
            slot = getattr(self, _SLOT, None)
            if slot is not None and slot.used_map:
                try:  # reallocated when buckets are rebuilt (before the forward pass)
                    slot.used = self.reducer._get_local_used_map()
                except Exception as e:
                    session.fail(e)

    return region


def _bind_buffers(args: tuple, kwargs: dict) -> dict | None:
    """``_distributed_broadcast_coalesced(self, tensors, buffer_size, authoritative_rank)``:
    the buffers (a list; anything else passes unrecorded) on the model's group."""
    tensors = args[1] if len(args) > 1 else kwargs.get("tensors")
    if not isinstance(tensors, list | tuple) or not tensors:
        return None
    return {"tensors": list(tensors), "group": args[0].process_group}


def _broadcast_by_dtype(session: Session, orig: Callable) -> Callable:
    """DDP's buffer broadcast, one call (and one record) per dtype and device: c10d
    broadcasts each such group on its own, so one record stands for one broadcast (up to
    ``buffer_size`` per group)."""
    recorded = wrap(orig, session, BUFFERS, bind=_bind_buffers, after=session.after)

    @functools.wraps(orig)
    def broadcast(self, tensors, buffer_size, authoritative_rank=0):
        groups: dict[tuple, list] = {}
        if guard.nested_or_compiling() or not isinstance(tensors, list | tuple) or \
                not all(isinstance(t, torch.Tensor) and t.layout == torch.strided
                        for t in tensors):
            return orig(self, tensors, buffer_size, authoritative_rank)
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            recorded(self, group, buffer_size, authoritative_rank)

    return broadcast


def _pickling(session: Session, getstate: Callable, setstate: Callable) -> tuple:
    """DDP's ``__getstate__``/``__setstate__`` without commcheck: the slot and marks stay
    with this process's model and the user's hooks pickle as the user gave them, as
    unpatched (``torch.save(ddp_model)``); a model unpickled after ``patch()`` is watched."""

    @functools.wraps(getstate)
    def __getstate__(self):
        attrs = getstate(self)
        for name in (_SLOT, _MARK, _BUILTIN, *REGIONS):
            attrs.pop(name, None)
        if attrs.get("_comm_hooks"):
            attrs["_comm_hooks"] = [(getattr(h, "__commcheck_original__", h), s)
                                    for h, s in attrs["_comm_hooks"]]
        return attrs

    @functools.wraps(setstate)
    def __setstate__(self, state):
        setstate(self, state)
        try:  # torch builds a new reducer without the old hooks: the default's slot is free
            if session.cfg.ddp:
                _give_slot(session, self)
        except Exception as e:
            session.fail(e)

    return __getstate__, __setstate__


def _install_regions(session: Session, installer: Installer) -> list[_Outside]:
    outsides = []
    for name in REGIONS:
        outside = _Outside(name, _own_region(session, getattr(DistributedDataParallel, name)))
        installer.set(DistributedDataParallel, name, outside.region)
        outside.ready()
        outsides.append(outside)
    return outsides


def install(session: Session, installer: Installer) -> None:
    DDP = DistributedDataParallel
    register, builtin, init = DDP.register_comm_hook, DDP._register_builtin_comm_hook, \
        DDP.__init__
    bind_init = binder(init)
    tally = session.tally

    @functools.wraps(register)
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        self._check_comm_hook(hook)  # torch's own checks, on the hook as the user gave it
        wrapped = hook
        try:
            wrapped = wrap_user_hook(session, hook)
        except Exception as e:
            session.fail(e)
        slot = getattr(self, _SLOT, None)
        if slot is None or slot.user:  # torch registers it (or refuses a second hook)
            register(self, state, wrapped)
            if slot is None:
                setattr(self, _MARK, True)
            return
        # torch's register_comm_hook, the reducer's registration aside: it holds the slot
        if self.logger is None:
            raise AssertionError("self.logger must not be None")
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((wrapped, state))
        slot.take(state, wrapped)

    @functools.wraps(builtin)
    def register_builtin_comm_hook(self, comm_hook_type) -> None:
        slot = getattr(self, _SLOT, None)
        python = None
        if slot is not None and not slot.user:
            if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
                python = slot.hook  # commcheck's default: the same numerics
            elif comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                    fp16_compress_hook,
                )
                python = wrap_user_hook(session, fp16_compress_hook)
        if python is None:
            builtin(self, comm_hook_type)
            setattr(self, _BUILTIN, True)
            return
        if self.logger is None:
            raise AssertionError("self.logger must not be None")
        self.logger._set_comm_hook_name(str(comm_hook_type))
        slot.take(self.process_group, python)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        mark = pg = None
        try:
            bound = bind_init((self, *args), kwargs) or {}
            pg = bound.get("process_group") or dist.distributed_c10d._get_default_group()
            mark = tally.mark(pg)
        except Exception as e:
            session.fail(e)
        init(self, *args, **kwargs)
        try:
            for outside in outsides:
                outside.ready(self)
            if pg is not None and pg is getattr(self, "process_group", None):
                tally.own(pg, mark)
            if session.cfg.ddp:
                attach(session, self)
        except Exception as e:
            session.fail(e)

    installer.set(_Installed, "session", session)
    register_comm_hook.__commcheck_original__ = register  # type: ignore[attr-defined]
    installer.set(DDP, "register_comm_hook", register_comm_hook)
    installer.set(DDP, "_register_builtin_comm_hook", register_builtin_comm_hook)
    installer.set(DDP, "__init__", __init__)
    getstate, setstate = _pickling(session, DDP.__getstate__, DDP.__setstate__)
    installer.set(DDP, "__getstate__", getstate)
    installer.set(DDP, "__setstate__", setstate)
    installer.set(DDP, "_distributed_broadcast_coalesced",
                  _broadcast_by_dtype(session, DDP._distributed_broadcast_coalesced))
    outsides = _install_regions(session, installer)  # ready at each DDP construction
