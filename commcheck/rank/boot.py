"""``commcheck run``'s way into a rank without touching its script: a ``sitecustomize``.

The launcher puts a directory holding a one-line ``sitecustomize.py`` first on the ranks'
``PYTHONPATH``; Python imports it at start-up, before ``__main__`` (a script or ``-m
module``), and it calls :func:`boot`. That runs the ``sitecustomize`` this one shadows
(site-packages', a distribution's, the user's: the next one on ``sys.path``), then
``commcheck.patch()`` — before the script imports anything, so before
``init_process_group``. Only a process torchrun started (``LOCAL_RANK`` set) with the
launcher's mark is patched, once: the mark is cleared for its children (data loader
workers, the relay), and torchrun's own agent is never patched.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys

MARK = "COMMCHECK_BOOT"  # "1": patch the next rank that starts; set by the launcher
log = logging.getLogger("commcheck")


def boot(bootstrap_dir: str) -> None:
    """Chain the shadowed ``sitecustomize``, then patch this rank. Never raises."""
    _chain(bootstrap_dir)
    if os.environ.get(MARK) != "1" or "LOCAL_RANK" not in os.environ:
        return
    os.environ[MARK] = f"patched:{os.getpid()}"
    try:
        from .runtime import patch

        patch()
    except Exception as e:  # DESIGN rule 7: never stop a job from starting
        print(f"commcheck: could not patch this rank ({e!r}); it runs unchecked",
              file=sys.stderr)


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
