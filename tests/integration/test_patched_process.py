"""What a training process that called ``commcheck.patch()`` has loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.integration
def test_a_patched_training_process_loads_no_collector_or_engine_module():
    code = ("import commcheck, sys; commcheck.patch(); "
            "print(sorted(m for m in sys.modules "
            "if m.startswith(('commcheck.collector', 'commcheck.engine'))))")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
