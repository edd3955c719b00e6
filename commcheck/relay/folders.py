"""Where a relay writes a run's dump and spill files: ``DIR/<run>/``, a folder only the
job's user may enter (0700). One that someone else made first, or that others may write
into, is never written into nor read back (its files could be anyone's): the relay makes a
fresh private folder beside it, once per run, and says so in one line.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ..wire.private import own_folder

log = logging.getLogger("commcheck")

_chosen: dict[tuple[str, str], Path] = {}


def run_dir_name(run: str) -> str:
    """The folder name of a run id (no path separators, never empty)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", run) or "run"


def run_folder(base: str, run: str, what: str) -> Path:
    """``base/<run>``, private (see the module's docstring); ``what``: the files it is for
    ("dump", "spill"), for the line that says a folder was passed over. Raises OSError."""
    key = (os.path.abspath(base), run)
    if key not in _chosen:
        folder, why = own_folder(base, run_dir_name(run))
        if why:
            log.warning("commcheck: %s; the %s files of run %r go to %s instead", why, what,
                        run, folder)
        _chosen[key] = folder
    return _chosen[key]
