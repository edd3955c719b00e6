"""Installing and removing the wrappers on ``torch.distributed`` and ``distributed_c10d``.

One generic wrapper (:mod:`.wrap`) serves every :class:`OpSpec`. Nested calls pass straight
through (:mod:`.guard`), so one user call yields one record. Both modules are patched because
frameworks bind collectives at import time. Object collectives are not wrapped: they call
the c10d tensor collectives through the module, so their size and payload transfers are
recorded as those ops, hashing the serialized bytes that actually travel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.optim.optimizer as optim_mod

from ..wire.ops import OPS, OpSpec
from . import coalescing, compiled, ddp, funcol, guard, inject, pgmethods
from .install import Installer, binder
from .session import Session
from .work import DoneWork
from .wrap import wrap

MODULES = (dist, c10d)
_ALWAYS_ASYNC = frozenset({"isend", "irecv"})


def _wrap(spec: OpSpec, name: str, orig: Callable, session: Session) -> Callable:
    always_async = name in _ALWAYS_ASYNC

    def skipped(bound: dict) -> object:
        return DoneWork() if always_async or bound.get("async_op") else None

    bind = binder(orig, spec.params)

    def bound_or_counted(args: tuple, kwargs: dict) -> dict | None:
        got = bind(args, kwargs)
        if got is None:  # torch rejects it, or a shim takes arguments torch does not
            session.skipped("arguments")
        return got

    return wrap(orig, session, spec, bind=bound_or_counted, after=session.after,
                skip=skipped, aside=guard.nested_or_compiling, rebind=True,
                fast=None if always_async else session.hotpath.make(spec),
                express=None if always_async else session.hotpath.express(spec))


class Patcher:
    """Owns what patch() changed so unpatch() can put every original back."""

    def __init__(self, session: Session):
        self.session = session
        self.installer = Installer()
        self.hook = None

    def install(self) -> None:
        same: dict[object, object] = {}
        for spec in OPS:
            for name in (spec.name, *spec.aliases):
                # Whatever each module holds is wrapped, bound by torch's signature: the
                # original, or a shim someone installed on one module or both.
                made: dict[int, Callable] = {}
                for mod in MODULES:
                    fn = getattr(mod, name, None)
                    if fn is None or not callable(fn):
                        continue
                    wrapped = made.get(id(fn))
                    if wrapped is None:
                        wrapped = made[id(fn)] = _wrap(spec, name, fn, self.session)
                        if name in _ALWAYS_ASYNC:
                            same[fn] = wrapped
                    self.installer.set(mod, name, wrapped)
        self._install_shims(same)
        funcol.install(self.session, self.installer)
        compiled.install(self.session, self.installer)
        ddp.install(self.session, self.installer)
        pgmethods.install(self.session, self.installer)
        self._hook_lifecycle()
        inject.attach(self.session)
        if dist.is_initialized():
            self.session.tally.snapshot()
        self.hook = optim_mod.register_optimizer_step_post_hook(
            lambda *_: self.session.on_step())

    def _install_shims(self, same: dict[object, object]) -> None:
        s = self.installer
        s.set(c10d, "_check_op", coalescing.check_op(c10d._check_op, same))
        cm = coalescing.coalescing_manager(c10d._coalescing_manager, self.session)
        batch = coalescing.batch_isend_irecv(c10d.batch_isend_irecv, same, self.session)
        for mod in MODULES:
            if getattr(mod, "_coalescing_manager", None) is c10d._coalescing_manager:
                s.set(mod, "_coalescing_manager", cm)
            if getattr(mod, "batch_isend_irecv", None) is c10d.batch_isend_irecv:
                s.set(mod, "batch_isend_irecv", batch)

    def _hook_lifecycle(self) -> None:
        init, destroy = c10d.init_process_group, c10d.destroy_process_group
        session = self.session

        @functools.wraps(init)
        def init_process_group(*args, **kwargs):
            result = init(*args, **kwargs)
            try:
                session.tally.snapshot()
                session.start()
            except Exception as e:
                session.fail(e)
            return result

        @functools.wraps(destroy)
        def destroy_process_group(group=None):
            try:
                if group is None or group is c10d.GroupMember.WORLD:
                    session.stop()
                else:
                    session.tally.settle(group)
            except Exception as e:
                session.fail(e)
            return destroy(group)

        for mod in MODULES:
            self.installer.set(mod, "init_process_group", init_process_group)
            self.installer.set(mod, "destroy_process_group", destroy_process_group)

    def uninstall(self) -> None:
        self.installer.undo()
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
