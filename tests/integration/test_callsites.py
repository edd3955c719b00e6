"""A collective a framework makes for the user is shown at both frames, as the user knows
them, from the rank's record through the analysis to the text report."""

from __future__ import annotations

import os
import subprocess

import pytest

from ..harness import WORKERS, call_lines, commcheck_cmd, run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
FW = """\
import torch.distributed as dist


def sync(t):
    dist.all_reduce(t)
    return t
"""


def test_a_framework_call_site_names_the_framework_and_the_users_line(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3" / "site-packages"
    (site / "fakefw").mkdir(parents=True)
    (site / "fakefw" / "__init__.py").write_text("")
    (site / "fakefw" / "dist.py").write_text(FW)
    dump = tmp_path / "dump"
    script = WORKERS / "framework_sites.py"
    env = {"COMMCHECK_DUMP_DIR": str(dump), "COMMCHECK_RUN_ID": "fw",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "COMMCHECK_INJECT": "bitflip:rank=1,op=all_reduce,call=2,bit=30"}
    for r in run_job(script, env, nnodes=1, nproc=2):
        assert r.returncode == 0, r.stdout[-3000:]
    db = tmp_path / "a.db"
    r = subprocess.run(commcheck_cmd("analyze", str(dump / "fw"), "--db", str(db)),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    line = call_lines(script)["sync"]
    assert "fakefw/dist.py:5 sync" in r.stdout, r.stdout
    assert f"← framework_sites.py:{line} main" in r.stdout
    assert "../" not in r.stdout and "site-packages" not in r.stdout, r.stdout
