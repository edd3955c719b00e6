"""The patched state of one training process: what ``commcheck.patch()`` and friends do.

The package root re-exports these functions lazily, so ``import commcheck`` stays cheap and a
collector that imports ``commcheck`` loads none of this.
"""

from __future__ import annotations

import atexit
import logging
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .patcher import Patcher
    from .session import Session

log = logging.getLogger("commcheck")
_active: tuple[Session, Patcher] | None = None


def patch(**overrides) -> bool:
    """Wrap the collectives. Idempotent; returns whether commcheck is active.

    Settings come from ``overrides`` > ``COMMCHECK_*`` > ``COMMCHECK_CONFIG`` file > defaults.
    A bad setting or a missing torch.distributed leaves training untouched and warns once.
    """
    global _active
    if _active is not None:
        return True
    from .config import ConfigError, load_config

    try:
        cfg = load_config(**overrides)
        if cfg.disable:
            warnings.warn("commcheck: disabled by COMMCHECK_DISABLE", stacklevel=2)
            return False
        import torch.distributed as dist

        if not dist.is_available():
            warnings.warn("commcheck: torch.distributed is unavailable; not patching",
                          stacklevel=2)
            return False
        from .inject import parse
        from .patcher import Patcher
        from .session import Session

        parse(cfg.inject)
    except ConfigError as e:
        warnings.warn(f"{e}; commcheck stays off", stacklevel=2)
        return False
    if not cfg.enabled_output:
        warnings.warn("commcheck: neither COMMCHECK_COLLECTOR nor COMMCHECK_DUMP_DIR is set; "
                      "records go nowhere", stacklevel=2)
    session = Session(cfg)
    patcher = Patcher(session)
    patcher.install()
    _active = (session, patcher)
    try:
        from .ending import watch as watch_ending

        watch_ending()
    except Exception as e:  # the goodbye then says less; training is untouched
        log.warning("commcheck: cannot watch how the process ends: %r", e)
    if dist.is_initialized():
        session.start()
    return True


def unpatch() -> None:
    """Restore the original functions and deliver what is queued."""
    global _active
    if _active is None:
        return
    session, patcher = _active
    _active = None
    patcher.uninstall()
    from .ending import unwatch

    unwatch()
    session.stop()


def active_session() -> Session | None:
    """The rank-side Session while patched (for commcheck's own probes), else None."""
    return _active[0] if _active is not None else None


def is_patched() -> bool:
    return _active is not None


def step() -> None:
    """Advance the training step for loops without a torch optimizer."""
    if _active is not None:
        _active[0].on_step()


def watch(model, hook=None, state=None) -> bool:
    """Record every gradient bucket of a ``DistributedDataParallel`` model.

    Models built after ``patch()`` are watched already (unless ``COMMCHECK_DDP=0``); this is
    for the others, and harmless on a watched model. ``hook`` (with ``state``) is registered
    as the user's comm hook. Returns False, with a warning, when commcheck is not patched or
    the model got a comm hook commcheck could not wrap (it is left untouched).
    """
    if _active is None:
        warnings.warn("commcheck.watch: commcheck is not patched; nothing is recorded",
                      stacklevel=2)
        return False
    from .ddp import watch as _watch

    return _watch(_active[0], model, hook, state)


def _at_exit() -> None:
    if _active is not None:
        try:
            _active[0].stop(at_exit=True)
        except Exception as e:  # never turn a clean exit into a failure
            log.warning("commcheck: shutdown error: %r", e)


atexit.register(_at_exit)
