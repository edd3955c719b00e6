"""A page (`commcheck report --html`'s) as a full-page PNG, taken by headless Chromium over
its DevTools pipe (tests/browser.py), for the docs (docs/report.png).

    PYTHONPATH=. python launch/tools/screenshot.py runs/report.html docs/report.png [--width 1280]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import browser  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1280)
    a = ap.parse_args()
    exe = browser.find()
    if exe is None:
        print(f"screenshot: {browser.WHY_NOT}", file=sys.stderr)
        return 2
    page = browser.Page(exe, width=a.width)
    try:
        page.open(Path(a.html).resolve().as_uri())
        if page.errors():
            print(f"screenshot: the page reported errors: {page.errors()}", file=sys.stderr)
            return 1
        Path(a.png).write_bytes(page.screenshot())
    finally:
        page.close()
    print(f"{a.png}: written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
