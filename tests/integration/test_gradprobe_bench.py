"""launch/bench/bench_gradprobe.py runs end to end at a small size and reports every mode it ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_bench_reports_each_mode(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "bench" / "bench_gradprobe.py"), "--width", "512",
         "--rounds", "1", "--block", "2", "--levels", "L0,L2", "--control", "--torch-kernels",
         "--dump-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=200, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        m = re.match(r"^(\S+)\s+([\d.]+)\s+([\d.]+)(.*)$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)), m.group(4).split())
    assert list(rows) == ["off", "off'", "L0", "L0/t", "L2", "L2/t"]
    assert rows["off"][1] == 1.0 and all(ms > 0 for ms, _, _ in rows.values())
    for name in ("L0", "L0/t", "L2", "L2/t"):
        ratio, (target, _msprobe, verdict, drops) = rows[name][1], rows[name][2]
        assert target == {"L0": "1.10", "L2": "1.30"}[name[:2]]
        assert verdict == ("ok" if ratio <= float(target) else "MISS"), rows[name]
        assert drops == "0"
    for mode in ("L0", "L0-t", "L2", "L2-t"):  # every probe wrote its steps
        assert len(list((tmp_path / mode / "rank0").glob("grad_summary_*.csv"))) >= 2, mode
