"""``commcheck run``'s way into a rank without touching its script: a ``sitecustomize``.

The launcher puts a directory holding a one-line ``sitecustomize.py`` first on the ranks'
``PYTHONPATH``; Python imports it at start-up, before ``__main__`` (a script or ``-m
module``), and it calls :func:`boot`. That runs the ``sitecustomize`` this one shadows
(site-packages', a distribution's, the user's: the next one on ``sys.path``), then
``commcheck.patch()`` — before the script imports anything, so before
``init_process_group``. Only a process torchrun started (``LOCAL_RANK`` set) with the
launcher's mark is patched, once: the mark is cleared for its children (data loader
workers, the relay), and torchrun's own agent is never patched.

The launcher starts torchrun while the node's relay starts; a rank then waits here, before
its script and at most the launcher's ``--start-timeout``, until the launcher creates the
release file in its private directory (the relay holds the run's lock, or cannot), so that
no rank records before the relay runs (docs/startup.md).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
import time

MARK = "COMMCHECK_BOOT"  # "1": patch the next rank that starts; set by the launcher
HOLD = "COMMCHECK_BOOT_HOLD"  # "<seconds>:<file>": wait for the file before patching
log = logging.getLogger("commcheck")


def boot(bootstrap_dir: str) -> None:
    """Chain the shadowed ``sitecustomize``, then patch this rank. Never raises."""
    _chain(bootstrap_dir)
    if os.environ.get(MARK) != "1" or "LOCAL_RANK" not in os.environ:
        return
    os.environ[MARK] = f"patched:{os.getpid()}"
    _held(os.environ.pop(HOLD, ""))
    try:
        from .runtime import patch

        patch()
    except Exception as e:  # DESIGN rule 7: never stop a job from starting
        print(f"commcheck: could not patch this rank ({e!r}); it runs unchecked",
              file=sys.stderr)


def _held(hold: str) -> None:
    """Wait until the launcher's release file exists, for at most the seconds it gives;
    then go on regardless (the rank starts its own relay if none runs)."""
    seconds, _, path = hold.partition(":")
    try:
        deadline = time.monotonic() + float(seconds)
    except ValueError:
        return
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"commcheck: the launcher did not release this rank within {seconds} s; "
                  f"it starts anyway", file=sys.stderr)
            return
        time.sleep(0.01)


def _chain(bootstrap_dir: str) -> None:
    """Run the ``sitecustomize`` that the bootstrap's own one hides, if there is one: it
    becomes ``sys.modules['sitecustomize']``, as if ours had never been there."""
    here = os.path.realpath(bootstrap_dir)
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as e:  # as Python's site module does: report, go on
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
              f"{type(e).__name__}: {e}", file=sys.stderr)
