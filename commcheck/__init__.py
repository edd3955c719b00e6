"""commcheck: check every collective of a torch.distributed job, out of band.

``import commcheck; commcheck.patch()`` at the top of a script started by torchrun.

This module is the public API and nothing else. Names resolve on first use, so that
``import commcheck`` loads neither torch nor the collector, and the collector (which imports
this package on its way to ``commcheck.collector``) loads nothing of the rank side.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_HOME = {
    "patch": "commcheck.rank.runtime",
    "unpatch": "commcheck.rank.runtime",
    "step": "commcheck.rank.runtime",
    "watch": "commcheck.rank.runtime",
    "is_patched": "commcheck.rank.runtime",
    "active_session": "commcheck.rank.runtime",
    "GradProbe": "commcheck.gradprobe",
    "PrecisionDebugger": "commcheck.gradprobe",
    "GradComparator": "commcheck.gradprobe",
}
__all__ = ["patch", "unpatch", "step", "watch", "is_patched", "active_session", "GradProbe",
           "PrecisionDebugger", "GradComparator", "__version__"]

if TYPE_CHECKING:
    from .gradprobe import GradComparator, GradProbe, PrecisionDebugger
    from .rank.runtime import active_session, is_patched, patch, step, unpatch, watch


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
