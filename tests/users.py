"""Two real unprivileged local users for the shared-node tests: the job's owner and an
intruder. Root bypasses every permission check, so an attack only means something between
two ordinary accounts; the tests that need them skip with the reason when that cannot be.

The accounts are made once per machine (``useradd``), with homes under a private test
directory, and reused: creating them is idempotent and they hold nothing.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .harness import ROOT

JOB, INTRUDER = "ccjob", "ccintruder"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a login of this user would have, plus this checkout on the path
        (the venv's interpreter is shared; its editable install points at the repo). The
        C++ DDP hook is off unless asked for: `commcheck run` would otherwise build it into
        this user's fresh cache first, about a minute (docs/native.md)."""
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("COMMCHECK_", "XDG_")) and k not in ("HOME", "USER",
                                                                         "LOGNAME", "TMPDIR")}
        return {**keep, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
                "PYTHONPATH": str(ROOT), "COMMCHECK_DDP_NATIVE": "0", **extra}

    def run(self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 120,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, user=self.uid, group=self.gid, extra_groups=[],
                              env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def popen(self, cmd: list[str], *, env: dict[str, str] | None = None,
              **kw) -> subprocess.Popen:
        from .harness import _started
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        p = subprocess.Popen(cmd, user=self.uid, group=self.gid, extra_groups=[],
                             env=env or self.env(), text=True, **kw)
        _started.append(p)
        return p

    def python(self, code: str, **kw) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-c", code], **kw)

    def chown(self, path: Path, mode: int | None = None) -> Path:
        os.chown(path, self.uid, self.gid)
        if mode is not None:
            os.chmod(path, mode)
        return path


class _NoUser(Exception):
    pass


def _ensure(name: str, homes: Path) -> User:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        homes.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["useradd", "--no-create-home", "--home-dir", str(homes / name),
                            "--shell", "/usr/sbin/nologin", "--user-group", name],
                           capture_output=True, text=True)
        if r.returncode != 0 and "already exists" not in r.stderr:
            raise _NoUser(f"cannot create user {name}: {r.stderr.strip()}") from None
        pw = pwd.getpwnam(name)
    home = Path(pw.pw_dir)
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, pw.pw_uid, pw.pw_gid)
    os.chmod(home, 0o700)
    return User(name, pw.pw_uid, pw.pw_gid, home)


def _let_search(path: Path) -> None:
    """Give others the search (x) bit on ``path``'s ancestors where it is missing (a 0700
    ``/root`` holding the interpreter or the checkout): nothing becomes listable or readable
    that was not, but an unprivileged user can reach the interpreter and the repo."""
    for d in path.parents:
        mode = d.stat().st_mode
        if not mode & 0o001:
            os.chmod(d, (mode & 0o7777) | 0o001)


def two_users() -> tuple[User, User]:
    """(job owner, intruder), or a skip that says why they cannot be had here (found out
    once per test session: the probe imports torch as the job's user)."""
    got = _two_users()
    if isinstance(got, str):
        pytest.skip(got)
    return got


@functools.cache
def _two_users() -> tuple[User, User] | str:
    if os.geteuid() != 0:
        return "needs root to create two unprivileged users"
    if shutil.which("useradd") is None:
        return "no useradd on this machine"
    homes = Path("/var/tmp/commcheck-test-homes")
    homes.mkdir(mode=0o755, exist_ok=True)
    os.chmod(homes, 0o755)
    try:
        job, intruder = _ensure(JOB, homes), _ensure(INTRUDER, homes)
    except _NoUser as e:
        return str(e)
    _let_search(Path(sys.executable).resolve())
    _let_search(ROOT)
    probe = job.python(f"import sys; sys.path.insert(0, {str(ROOT)!r}); import commcheck, torch")
    if probe.returncode != 0:
        return (f"an unprivileged user cannot import this checkout "
                f"({ROOT} or its venv not readable): {probe.stderr.strip()[-200:]}")
    return job, intruder
