"""Bad input through the installed ``commcheck`` entry point: one line, status 2."""

from __future__ import annotations

import subprocess

import pytest

from ..harness import commcheck_cmd
from ..unit import test_cli_errors as errors

CASES = errors.CASES
files = errors.files  # the fixture of the in-process tests


@pytest.mark.parametrize("name", ["collect-random-db", "report-corrupt-page", "keygen-existing",
                                  "grad-missing-runs"])
def test_the_installed_entry_point_behaves_the_same(name, files):
    r = subprocess.run(commcheck_cmd(*CASES[name]), cwd=files, capture_output=True, text=True,
                       timeout=60)
    lines = r.stderr.strip("\n").splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("commcheck"), r.stderr
