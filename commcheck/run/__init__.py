"""``commcheck run``: torchrun with commcheck in every rank, the script untouched.

Split by job: :mod:`.options` reads the command line (commcheck's options, torchrun's, the
script's) into a :class:`~.options.Plan`; :mod:`.processes` starts and stops the collector,
the relay and torchrun; :mod:`.main` puts them in order and prints the report. The command
is a process manager: it imports neither side of commcheck, nor torch where the command
line is plain (docs/startup.md).
"""

from __future__ import annotations

import sys


class LaunchError(Exception):
    """Bad input or a launcher that cannot start: one line on stderr, exit status 2."""


def log(msg: str) -> None:
    print(f"commcheck run: {msg}", file=sys.stderr, flush=True)
