"""``python -m commcheck.relay ...``: what a rank runs, detached, when no relay is there."""

from __future__ import annotations

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
