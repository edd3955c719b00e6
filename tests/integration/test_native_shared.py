"""Another local user's code never runs inside the training ranks (issue 26, item 1;
docs/native.md, "Threat model"): with the job user's cache unwritable, the first-use builds
go to ``$TMPDIR/commcheck-<uid>``, a name anyone can predict. The intruder made that
directory first and planted the kernel, the per-call path and the DDP hook under the exact
names the job would load, each with a constructor that leaves a marker. The job refuses
the directory in one line, builds in a fresh private one, still computes, and the markers
never appear."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ..users import two_users

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void)
{
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("intruder code ran", f); fclose(f); }
}
"""

JOB = """
import torch
from commcheck.native import ddphook, hot, loader
lib = loader.load(loader._build())  # the first-use path, as a tree without setup.py's build
stats, _ = loader.Kernel(lib, loader._load_xxh3()).stats(torch.arange(1000.0))
print("SUM", stats.sum)
print("HOT", hot._built().__file__)
print("DDP", ddphook.module())
"""


def _names() -> dict[str, str]:
    """The files the job would load, by the same keys the job computes."""
    from commcheck.native import ddphook, hot, loader

    cc = shutil.which("cc")
    names = {"kernel": loader.library_name(cc),
             "hot": loader.library_name(cc, *hot._build_args())}
    with contextlib.suppress(OSError):  # no C++ toolchain: only the C libraries planted
        names["ddp"] = ddphook.library_name()[0] + ".so"
    return names


def test_a_planted_directory_and_libraries_are_refused_and_never_loaded(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: nothing is built or loaded from a cache here")
    job, intruder = two_users()
    base = Path(tempfile.mkdtemp(prefix="commcheck-shared-", dir="/var/tmp"))
    try:
        os.chmod(base, 0o1777)  # a /tmp of its own: sticky, everyone may create in it
        marks, planted = base / "marks", base / f"commcheck-{job.uid}"
        marks.mkdir()
        job.chown(marks, 0o700)
        planted.mkdir()  # the intruder's, before the job ever ran
        intruder.chown(planted, 0o777)
        names = _names()
        for what, name in names.items():
            so = planted / name
            src = tmp_path / f"{what}.c"
            src.write_text(PLANTED)
            subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marks}/{what}"', "-o",
                            str(so), str(src)], check=True, capture_output=True)
            intruder.chown(so, 0o755)
        r = job.run([sys.executable, "-c", JOB],
                    env=job.env(XDG_CACHE_HOME="/sys", TMPDIR=str(base),
                            COMMCHECK_DDP_NATIVE="1"))
        assert r.returncode == 0, r.stderr[-2000:]
        out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
        assert float(out["SUM"]) == 499500.0
        assert out["HOT"].startswith(f"{base}/commcheck-native-")  # a fresh private build
        assert out["DDP"] == "None"
        refusals = [ln for ln in r.stderr.splitlines() if "refused" in ln]
        assert refusals == [f"commcheck: refused the native build directory {planted}: owned "
                            f"by uid {intruder.uid}, not by this user (uid {job.uid}) or "
                            f"root; trying the next place"]
        if "ddp" in names:
            assert "native DDP hook is unavailable (not built on this node:" in r.stderr
        assert sorted(os.listdir(marks)) == []  # no constructor of the intruder's ran
        assert not list(base.glob("commcheck-native-*"))  # the private build left nothing
    finally:
        shutil.rmtree(base, ignore_errors=True)
