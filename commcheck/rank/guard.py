"""When a wrapper must step aside: nested calls, tracing and compilation.

One user call gives one record: while a wrapped call runs, calls it makes on the same
thread (a deprecated alias calling its successor, ``send`` calling ``isend``) pass straight
through. Under ``torch.compile`` or another tracer the wrappers must be invisible, so that
the tracer sees the original function (Dynamo maps ``dist.*`` to functional collectives by
identity) and nothing of commcheck ends up in a graph.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()
_compiling = torch.compiler.is_compiling


def isolate() -> bool:
    """From here on, calls on this thread pass through the wrappers (commcheck's own, and
    what a wrapped call makes); returns the previous state for :func:`restore`."""
    prev = getattr(_local, "busy", False)
    _local.busy = True
    return prev


def restore(prev: bool) -> None:
    _local.busy = prev


def compiling() -> bool:
    """True while Dynamo traces: the wrapper must reduce to a call of the original."""
    return _compiling()


def nested_or_compiling() -> bool:
    """A ``dist.*`` wrapper steps aside: a wrapped call is running, or Dynamo traces."""
    return _compiling() or getattr(_local, "busy", False)


def nested_compiling_or_tracing() -> bool:
    """A functional-collective wrapper steps aside: also under export or ``make_fx``."""
    return _compiling() or getattr(_local, "busy", False) or tracing()


def tracing() -> bool:
    """Fake, proxy or Python-dispatcher tracing outside Dynamo (export, make_fx)."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return True
    return torch._C._dispatch_tls_is_dispatch_key_included(
        torch._C.DispatchKey.PythonDispatcher)
