"""The DDP hook made ready before torchrun (``commcheck run``'s :func:`run.main.prebuild`, and
``commcheck build``): built once with one line of progress, silent and fast once built, one
line and the Python hook where it cannot be built; the ranks are told the private directory
it is in."""

from __future__ import annotations

import time

import pytest

from commcheck.cli import main as cli
from commcheck.native import ddphook, private
from commcheck.run import main as run_main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(private.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(private.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    try:
        ddphook.library_name()
    except OSError as exc:
        pytest.skip(f"no C++ toolchain: {exc}")
    return tmp_path / "cache"


def test_built_once_before_torchrun_then_silent(cache, monkeypatch, capsys):
    builds = []

    def build(name, target, compiler):  # the minute-long cpp_extension build, stood in for
        builds.append(name)
        target.write_bytes(b"library")
        target.chmod(0o700)
        return "module"

    monkeypatch.setattr(ddphook, "_build", build)
    assert run_main.prebuild() == {private.ENV: str(cache)}
    said = capsys.readouterr().err.splitlines()
    assert said[0] == ("commcheck run: building the native DDP hook (once per node and torch "
                       "version; about a minute)")
    assert said[1].startswith("commcheck run: built the native DDP hook in 0 s (") and \
        len(said) == 2 and len(builds) == 1
    t0 = time.monotonic()
    assert run_main.prebuild() == {private.ENV: str(cache)}
    assert time.monotonic() - t0 < 1.0 and capsys.readouterr().err == "" and len(builds) == 1


def test_no_compiler_said_once_and_training_goes_on(cache, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "no-such-compiler-commcheck")
    assert run_main.prebuild() == {}
    assert capsys.readouterr().err.splitlines() == [
        "commcheck run: the native DDP hook cannot be built (no C++ compiler "
        "'no-such-compiler-commcheck' on PATH); DDP buckets are checked by the Python hook "
        "(slower)"]
    assert cli(["build"]) == 1  # the explicit build says so with its status
    out = capsys.readouterr().out
    assert "commcheck build: C kernel: " in out and "cannot be built (no C++ compiler" in out
    monkeypatch.setenv(ddphook.ENV, "0")
    assert run_main.prebuild() == {} and capsys.readouterr().err == ""
    assert cli(["build"]) == 0
