"""The C parts built when the package is installed, and no build inside training (issue 30,
items 4 and 7; docs/native.md).

One ``pip install .`` of this checkout into a new venv (torch and the rest seen through the
shared one), then one rank run from it with no C compiler on ``PATH`` (``cc``, ``gcc``
absent; ``c++`` and ninja present, so the rank *could* JIT-build the DDP hook) and a fresh
cache: the kernel and the per-call path are the installed extensions, their fingerprints
are xxh3's, nothing is compiled (no cache directory appears), and the first DDP step, with
the hook not built, takes the Python hook at once (said once) instead of a minute's build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ..harness import ROOT, WORKERS, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROBE = """
import os, runpy, shutil, sys, time
import torch, xxhash
from commcheck.native import hot, loader
assert shutil.which("cc") is None and shutil.which("gcc") is None, os.environ["PATH"]
k, h = loader.kernel(), hot.module()
print("KERNEL", k._lib._name)
print("HOT", h.__file__)
fp = loader.fingerprinter()
t = torch.randn(1024)
got = fp(t, fp.code(t), True, True)[0]
assert got[1] << 64 | got[0] == xxhash.xxh3_128_intdigest(t.numpy().tobytes())
t0 = time.perf_counter()
for _ in range(20000):
    fp(t, 0, True, True)
print(f"PERCALL {(time.perf_counter() - t0) / 20000 * 1e6:.2f}")
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _source(dest: Path) -> Path:
    """The files a source distribution holds (no build output, no in-place libraries)."""
    dest.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "commcheck", dest / "commcheck",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dest


def _venv(where: Path) -> Path:
    """A venv on the base interpreter that sees the shared venv's packages (torch is not
    installed again); pip, setuptools and the rest come from there too."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)],
                   check=True, capture_output=True, timeout=60)
    site = Path(subprocess.check_output(
        [where / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                         "['purelib'])"], text=True).strip())
    (site / "shared-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where / "bin" / "python"


def test_an_installed_package_runs_its_compiled_kernel_and_never_builds_in_a_rank(tmp_path):
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja: a rank could not build the hook here anyway")
    src = _source(tmp_path / "src")
    python = _venv(tmp_path / "venv")
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--no-build-isolation", "--disable-pip-version-check", str(src)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    site = python.parent.parent / "lib"
    built = sorted(p.name.split(".")[0] for p in site.rglob("commcheck/native/_*.so"))
    assert built == ["_hot", "_kernel"]

    tools = tmp_path / "tools"  # a C++ toolchain for the hook, no C compiler for the kernel
    tools.mkdir()
    for name in ("c++", "ninja"):
        (tools / name).symlink_to(shutil.which(name))
    fresh = {d: tmp_path / d for d in ("home", "cache", "tmp", "run")}
    for d in (fresh["home"], fresh["tmp"], fresh["run"]):
        d.mkdir()
    env = {"PATH": f"{python.parent}:{tools}", "HOME": str(fresh["home"]),
           "XDG_CACHE_HOME": str(fresh["cache"]), "TMPDIR": str(fresh["tmp"]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "COMMCHECK_DUMP_DIR": str(fresh["run"]), "COMMCHECK_RUN_ID": "installed"}
    r = subprocess.run([python, "-c", PROBE, str(WORKERS / "ddp_first_step.py")], env=env,
                       cwd=fresh["run"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert out["KERNEL"].startswith(str(site)) and out["HOT"].startswith(str(site))
    assert not fresh["cache"].exists()  # nothing was compiled, no cache was even made
    assert [p.name for p in fresh["tmp"].iterdir() if "commcheck" in p.name] == []
    assert out["HOOK"] == "python"
    hook_lines = [ln for ln in r.stderr.splitlines() if "DDP hook" in ln]
    assert len(hook_lines) == 1 and "not built on this node" in hook_lines[0], r.stderr
    first, *later = (float(s) for s in out["STEPS"].split())
    # A build in the rank costs tens of seconds; the first step's own warm-up, a fraction.
    assert first <= max(later) + 1.0, out["STEPS"]
    print(f"per call {out['PERCALL']} µs, setup {out['SETUP']} s, steps {out['STEPS']} s",
          file=sys.stderr)
    os.environ.get("COMMCHECK_KEEP") or shutil.rmtree(tmp_path / "venv", ignore_errors=True)
