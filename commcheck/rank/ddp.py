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
from .install import Installer
from .session import Call, Session
from .wrap import wrap

DEFAULT = BY_NAME["ddp_allreduce"]
USER = BY_NAME["ddp_bucket"]
_MARK = "_commcheck_watched"


def _finish_on(session: Session) -> Callable[[Call, torch.futures.Future], torch.futures.Future]:
    """The hooks' ``after``: fingerprint the bucket's result when ``fut`` completes; DDP gets
    the same value."""

    def after(call: Call, fut: torch.futures.Future) -> torch.futures.Future:
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


def default_hook(session: Session) -> Callable:
    reduce = wrap(_allreduce_bucket, session, DEFAULT, bind=_bind_bucket,
                  after=_finish_on(session))

    def commcheck_allreduce_hook(state, bucket):
        group = state if state is not None else dist.group.WORLD
        # DDP's delayed all-reduce path passes (grad, param) and expects it reduced in place.
        delayed = isinstance(bucket, tuple)
        buffer = bucket[0] if delayed else bucket.buffer()
        buffer.div_(group.size())
        return reduce(buffer, group, delayed)

    return commcheck_allreduce_hook


def _bind_user_bucket(args: tuple, kwargs: dict) -> dict | None:
    """A user hook's bucket; the (grad, param) pairs of DDP's delayed path are not recorded
    (the collectives the hook calls for them are, each by its own wrapper)."""
    state, bucket = args
    group = getattr(state, "process_group", state)
    if not isinstance(group, dist.ProcessGroup):
        group = None
    return None if isinstance(bucket, tuple) else {"tensor": bucket.buffer(), "group": group}


def wrap_user_hook(session: Session, hook: Callable) -> Callable:
    """``hook`` recorded as ``ddp_bucket``; the collectives it calls are recorded too."""
    return wrap(hook, session, USER, bind=_bind_user_bucket, after=_finish_on(session),
                isolate=False)


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
