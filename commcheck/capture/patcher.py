"""Installing and removing the wrappers on ``torch.distributed`` and ``distributed_c10d``.

One generic wrapper serves every :class:`OpSpec`. A thread-local guard lets nested calls
(a deprecated alias calling its successor, a collective built from another) pass straight
through, so one user call yields one record. Both modules are patched because frameworks
bind collectives at import time.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.optim.optimizer as optim_mod

from ..ops import OPS, OpSpec
from .session import Session

MODULES = (dist, c10d)
_guard = threading.local()


def _binder(orig: Callable) -> Callable[[tuple, dict], dict | None]:
    """A cheap ``inspect.Signature.bind`` for plain positional-or-keyword signatures.

    Returns None for calls the real function will reject anyway; those pass through.
    """
    params = inspect.signature(orig).parameters
    names = list(params)
    defaults = {k: p.default for k, p in params.items() if p.default is not p.empty}

    def bind(args: tuple, kwargs: dict) -> dict | None:
        if len(args) > len(names) or not kwargs.keys() <= params.keys():
            return None
        bound = dict(defaults)
        bound.update(zip(names, args, strict=False))
        bound.update(kwargs)
        return bound

    return bind


def _wrap(spec: OpSpec, orig: Callable, session: Session) -> Callable:
    bind = _binder(orig)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if getattr(_guard, "busy", False):
            return orig(*args, **kwargs)
        call, bound = None, None
        try:
            bound = bind(args, kwargs)
            if bound is not None:
                call = session.before(spec, bound)
        except Exception as e:
            session.fail(e)
        _guard.busy = True
        try:
            result = orig(*args, **kwargs)
        finally:
            _guard.busy = False
        if call is None:
            return result
        try:
            return session.after(call, result, bool(bound.get("async_op")))
        except Exception as e:
            session.fail(e)
            return result

    wrapper.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return wrapper


class Patcher:
    """Owns what patch() changed so unpatch() can put every original back."""

    def __init__(self, session: Session):
        self.session = session
        self.saved: list[tuple[object, str, object]] = []
        self.hook = None

    def install(self) -> None:
        originals: dict[str, Callable] = {}
        for spec in OPS:
            for name in (spec.name, *spec.aliases):
                fn = getattr(c10d, name, None)
                if fn is None:
                    continue
                originals[name] = fn
                wrapped = _wrap(spec, fn, self.session)
                for mod in MODULES:
                    if getattr(mod, name, None) is fn:
                        self._set(mod, name, wrapped)
        self._hook_lifecycle()
        self.hook = optim_mod.register_optimizer_step_post_hook(
            lambda *_: self.session.on_step())

    def _hook_lifecycle(self) -> None:
        init, destroy = c10d.init_process_group, c10d.destroy_process_group
        session = self.session

        @functools.wraps(init)
        def init_process_group(*args, **kwargs):
            result = init(*args, **kwargs)
            try:
                session.start()
            except Exception as e:
                session.fail(e)
            return result

        @functools.wraps(destroy)
        def destroy_process_group(group=None):
            if group is None or group is c10d.GroupMember.WORLD:
                try:
                    session.stop()
                except Exception as e:
                    session.fail(e)
            return destroy(group)

        for mod in MODULES:
            self._set(mod, "init_process_group", init_process_group)
            self._set(mod, "destroy_process_group", destroy_process_group)

    def _set(self, mod: object, name: str, value: object) -> None:
        self.saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    def uninstall(self) -> None:
        for mod, name, value in reversed(self.saved):
            setattr(mod, name, value)
        self.saved.clear()
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
