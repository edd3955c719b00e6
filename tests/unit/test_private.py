"""Where native code may be loaded from (commcheck/native/private.py): every directory from
``/`` down checked for another user's hand, the library opened without following links and
checked before it is loaded. Ownership by another user needs root to arrange (chown)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from commcheck.native import ddphook, private

OTHER = 4242  # a uid that is neither this user nor root


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")


def test_a_private_chain_is_accepted_and_a_cache_made_0700(tmp_path, monkeypatch):
    monkeypatch.setenv(private.ENV, str(tmp_path / "a" / "cache"))
    got = next(private.cache_dirs(fresh=False))
    assert got == tmp_path / "a" / "cache"
    assert stat.S_IMODE(got.stat().st_mode) == 0o700


def test_a_cache_of_ours_others_could_write_is_made_private_again(tmp_path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    assert private.check_dir(d) == d and stat.S_IMODE(d.stat().st_mode) == 0o700


def test_another_users_directory_anywhere_on_the_way_is_refused(tmp_path, monkeypatch, caplog):
    need_root()
    shared = tmp_path / "shared"
    (shared / "mine").mkdir(parents=True)
    os.chown(shared, OTHER, OTHER)
    with pytest.raises(private.Refused, match=f"{shared}: owned by uid {OTHER}"):
        private.check_dir(shared / "mine")
    monkeypatch.setenv(private.ENV, str(shared / "mine"))
    monkeypatch.setattr(private.tempfile, "tempdir", str(tmp_path))
    caplog.set_level("WARNING", "commcheck")
    dirs = private.cache_dirs()
    assert next(dirs) == tmp_path / f"commcheck-{os.getuid()}"  # the next place
    assert caplog.text.count("refused the native build directory") == 1


def test_a_group_writable_directory_without_sticky_bit_is_refused(tmp_path):
    d = tmp_path / "team"
    (d / "cache").mkdir(parents=True)
    os.chmod(d, 0o775)
    with pytest.raises(private.Refused, match="writable by other users"):
        private.check_dir(d / "cache")
    os.chmod(d, 0o1777)  # like /tmp: others cannot rename what is ours
    assert private.check_dir(d / "cache") == d / "cache"


@pytest.mark.parametrize("how", ["link", "foreign", "world-writable", "fifo"])
@pytest.mark.timeout(10)
def test_a_library_that_is_not_ours_alone_is_never_opened(tmp_path, how):
    lib = tmp_path / "lib.so"
    real = tmp_path / "real.so"
    real.write_bytes(b"\x7fELF")
    os.chmod(real, 0o600)
    if how == "link":
        lib.symlink_to(real)
    elif how == "fifo":
        os.mkfifo(lib)
    else:
        lib.write_bytes(b"\x7fELF")
        if how == "foreign":
            need_root()
            os.chown(lib, OTHER, OTHER)
        else:
            os.chmod(lib, 0o666)
    with pytest.raises(private.Refused), private.opened(lib, keep=False):
        pass
    with private.opened(real, keep=False) as name:  # the checked descriptor is what is loaded
        assert Path(name).read_bytes() == b"\x7fELF" and name.startswith("/proc/self/fd/")


def test_a_rank_never_builds_the_ddp_hook(tmp_path, monkeypatch, caplog):
    """A fresh cache: the rank's load says "not built" at once, and builds nothing."""
    monkeypatch.setenv(private.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(private.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(ddphook, "_build", lambda *a: pytest.fail("a rank built the hook"))
    ddphook._module.cache_clear()
    try:
        with caplog.at_level("WARNING", "commcheck"):
            assert ddphook.module() is None
            assert ddphook.module() is None
    except OSError as exc:  # no C++ compiler or headers: said the same way
        pytest.skip(str(exc))
    finally:
        ddphook._module.cache_clear()
    lines = [r.message for r in caplog.records if "DDP hook" in r.message]
    if "not built" not in caplog.text:
        pytest.skip(f"no C++ toolchain here: {lines}")
    assert len(lines) == 1 and "not built on this node: `commcheck build`" in lines[0]
    assert not (tmp_path / "cache").exists() and not list((tmp_path / "tmp").iterdir())


def test_a_library_built_from_other_sources_is_not_used(tmp_path, caplog):
    """setup.py's key against the sources beside the library: an edited tree is not served
    by its last build (one line, then the first-use build)."""
    from commcheck.native import hot, loader

    for src in hot.SOURCES:
        (tmp_path / src.name).write_bytes(src.read_bytes())
    origin = tmp_path / "_hot.so"
    key = loader.source_key(hot.SOURCES)
    assert loader.current(origin, key, hot.SOURCES)
    (tmp_path / "kernel.c").write_text("/* edited */")
    with caplog.at_level("WARNING", "commcheck"):
        assert not loader.current(origin, key, hot.SOURCES)
    assert "_hot.so was built from other sources" in caplog.text
    if loader.installed_origin("_hot") is not None:  # this tree's own build is current
        assert key == hot._installed().SOURCE_KEY
        assert loader.installed_library() is not None
