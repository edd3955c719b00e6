"""DistributedDataParallel: record every gradient bucket through a comm hook.

Without a hook, DDP's reducer all-reduces buckets in C++ and never calls the Python API, so
commcheck cannot see them: :func:`watch` installs a hook. With no user hook it keeps DDP's
numerics — exactly torch's ``allreduce_hook``: divide the bucket by the group size, then
SUM all-reduce — and records the bucket as ``ddp_allreduce`` (replicated, reduction check).
A user hook registered after ``patch()`` is wrapped as it is registered: it keeps running
unchanged and its result is recorded as ``ddp_bucket`` (replicated only: compression or
low-rank hooks are not sums). A hook registered before ``patch()`` lives in C++ and cannot
be wrapped; :func:`watch` then refuses with a warning and leaves it alone.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..wire.ops import BY_NAME
from . import guard
from .install import Installer
from .session import SKIP, Session

DEFAULT = BY_NAME["ddp_allreduce"]
USER = BY_NAME["ddp_bucket"]
_MARK = "_commcheck_watched"


def _record(session: Session, fut: torch.futures.Future, call: object) -> torch.futures.Future:
    """Chain fingerprinting of the bucket's result after ``fut``; DDP gets the same value."""
    if call is None or call is SKIP:
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


def default_hook(session: Session) -> Callable:
    def commcheck_allreduce_hook(state, bucket):
        group = state if state is not None else dist.group.WORLD
        # DDP's delayed all-reduce path passes (grad, param) and expects it reduced in place.
        delayed = isinstance(bucket, tuple)
        buffer = bucket[0] if delayed else bucket.buffer()
        buffer.div_(group.size())
        call = None
        try:
            call = session.before(DEFAULT, {"tensor": buffer, "group": group,
                                            "op": dist.ReduceOp.SUM})
        except Exception as e:
            session.fail(e)
        covered = session.tally.enter(group)
        try:
            with guard.passthrough():
                if delayed:
                    dist.all_reduce(buffer, group=group)
                    fut = torch.futures.Future()
                    fut.set_result(buffer)
                else:
                    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
                    fut = fut.then(lambda f: f.value()[0])
        finally:
            session.tally.leave(group, covered)
        return _record(session, fut, call)

    return commcheck_allreduce_hook


def wrap_user_hook(session: Session, hook: Callable) -> Callable:
    @functools.wraps(hook)
    def commcheck_wrapped_hook(state, bucket):
        call, group = None, None
        try:
            group = getattr(state, "process_group", state)
            if not isinstance(group, dist.ProcessGroup):
                group = None
            if not isinstance(bucket, tuple):
                call = session.before(USER, {"tensor": bucket.buffer(), "group": group})
        except Exception as e:
            session.fail(e)
        group = group or dist.group.WORLD
        covered = session.tally.enter(group)
        try:
            fut = hook(state, bucket)
        finally:
            session.tally.leave(group, covered)
        return _record(session, fut, call)

    commcheck_wrapped_hook.__commcheck_original__ = hook  # type: ignore[attr-defined]
    return commcheck_wrapped_hook


def watch(session: Session, model: object, hook: Callable | None = None,
          state: object = None) -> bool:
    """Install the recording hook on a DDP model; False (with a warning) if impossible."""
    if not isinstance(model, DistributedDataParallel):
        warnings.warn(f"commcheck.watch: {type(model).__name__} is not DistributedDataParallel;"
                      f" nothing to watch", stacklevel=3)
        return False
    if getattr(model, _MARK, False):
        return True
    if model._comm_hooks:
        warnings.warn("commcheck.watch: this DDP model already has a comm hook registered "
                      "before commcheck.patch(); it cannot be wrapped after the fact, so its "
                      "buckets stay unchecked. Call commcheck.patch() before registering it, "
                      "or pass it as commcheck.watch(model, hook=..., state=...) instead of "
                      "register_comm_hook.", stacklevel=3)
        return False
    if hook is None:
        DistributedDataParallel.register_comm_hook.__commcheck_original__(  # type: ignore
            model, state if state is not None else model.process_group, default_hook(session))
    else:
        model.register_comm_hook(state, hook)
    setattr(model, _MARK, True)
    return True


def install(session: Session, installer: Installer) -> None:
    orig = DistributedDataParallel.register_comm_hook

    @functools.wraps(orig)
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        wrapped = hook
        try:
            if not getattr(hook, "__commcheck_original__", None):
                wrapped = wrap_user_hook(session, hook)
        except Exception as e:
            session.fail(e)
        orig(self, state, wrapped)
        setattr(self, _MARK, True)

    register_comm_hook.__commcheck_original__ = orig  # type: ignore[attr-defined]
    installer.set(DistributedDataParallel, "register_comm_hook", register_comm_hook)
