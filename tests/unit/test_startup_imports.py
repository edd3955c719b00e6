"""What the processes of ``commcheck run`` import at start-up: every module here is on the
path from the launcher to the first collective (docs/startup.md)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules_after(statement: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", f"{statement}; import sys; "
                          f"print(' '.join(sys.modules))"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return set(out.split())


def test_the_cli_and_the_collector_start_without_plotting_or_metrics_libraries():
    loaded = modules_after("import commcheck.cli, commcheck.collector.daemon")
    assert "commcheck.collector.daemon" in loaded
    assert not {"matplotlib", "prometheus_client"} & loaded
