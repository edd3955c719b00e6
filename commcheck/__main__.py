"""``python -m commcheck``: the ``commcheck`` command."""

import sys

from .cli import main

sys.exit(main())
