"""The checks of commcheck/wire/private.py and what uses them, for what one user can do
alone: a symlink planted at the relay's lock name, a run folder others may write into, a
symlinked ``*.ring`` in a searched directory. (Another *user's* files:
tests/integration/test_security_files.py.)"""

from __future__ import annotations

import json
import os
import stat

import pytest

from commcheck.collector.analyze import FOREIGN, find_sources
from commcheck.rank.ring import RingWriter
from commcheck.wire.private import dir_problem, file_problem, fresh_dir, own_folder
from commcheck.wire.relay_settings import RelaySettings
from commcheck.wire.ring import (
    Identity,
    Ring,
    blocked,
    destination,
    lock_name,
    log_name,
    ring_prefix,
)

from ..records import rec


def _ident(tmp_path, run: str) -> Identity:
    return Identity(run=run, rank=0, host="h", world=1, node=-1, pid=os.getpid(),
                    dest=destination("", str(tmp_path / "dump")))


def test_files_and_folders_are_ours_alone_or_refused(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"")
    os.chmod(f, 0o600)
    assert file_problem(os.lstat(f)) == ""
    os.chmod(f, 0o640)
    assert file_problem(os.lstat(f)) == "mode 640, expected 600"
    (tmp_path / "l").symlink_to(f)
    assert file_problem(os.lstat(tmp_path / "l")) == "not a regular file"
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert dir_problem(os.lstat(d)) == dir_problem(os.lstat(d), strict=True) == ""
    os.chmod(d, 0o1777)  # like /tmp: fine for a ring folder, not for a run folder of ours
    assert dir_problem(os.lstat(d)) == ""
    assert "others may write" in dir_problem(os.lstat(d), strict=True)
    os.chmod(d, 0o777)
    assert dir_problem(os.lstat(d)).endswith("others may write into it and it has no sticky bit")


@pytest.mark.parametrize("name", [lock_name, log_name])
def test_a_symlink_at_the_relays_lock_or_log_moves_the_ring_to_a_fresh_folder(tmp_path, name):
    rings = tmp_path / "rings"
    rings.mkdir(mode=0o700)
    ident = _ident(tmp_path, "moved")
    prefix = ring_prefix(os.getuid(), ident.run, ident.dest, ident.node)
    (rings / name(prefix)).symlink_to(tmp_path / "elsewhere")
    assert blocked(str(rings), prefix) == f"{rings / name(prefix)}: not a regular file"
    w = RingWriter.create(str(rings), ident, 1 << 16, RelaySettings(run=ident.run, expect=4))
    try:
        folder = os.path.dirname(w.path)
        assert os.path.dirname(folder) == str(rings) and folder != str(rings)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert w.launch is not None and w.launch.ring_dir == folder
        assert w.launch.settings == RelaySettings(run=ident.run, expect=1, ring_dir=folder)
        assert w.counters == {f"refused_file:{rings / name(prefix)}: not a regular file": 1}
        assert not (tmp_path / "elsewhere").exists()
    finally:
        w.launch = None
        w.close(linger=0)


def test_ring_creation_leaves_no_name_behind_but_the_ring(tmp_path):
    rings = tmp_path / "rings"
    w = RingWriter.create(str(rings), _ident(tmp_path, "clean"), 1 << 16)
    w.close(linger=0)
    assert [p.name for p in rings.iterdir()] == [os.path.basename(w.path)]
    Ring.open(w.path).close()


def test_a_run_folder_open_to_others_is_passed_over_for_a_fresh_private_one(tmp_path):
    base = tmp_path / "dumps"
    assert own_folder(base, "run") == (base / "run", "")
    assert stat.S_IMODE(os.stat(base / "run").st_mode) == 0o700
    os.chmod(base / "run", 0o777)
    folder, why = own_folder(base, "run")
    assert folder.parent == base and folder.name.startswith("run-")
    assert why == f"{base / 'run'}: mode 777: others may write into it"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    with pytest.raises(OSError, match="no private folder"):
        fresh_dir([str(tmp_path / "missing")], "x-")


def test_analyze_passes_by_a_symlinked_file_and_names_it(tmp_path, capsys):
    from commcheck.cli import main

    w = RingWriter.create(str(tmp_path / "rings"), _ident(tmp_path, "walk"), 1 << 16)
    w.start()
    w.write_record(rec(seq=0, ranks=(0,)))
    w.close(linger=0)
    elsewhere = tmp_path / "elsewhere.ring"
    os.link(w.path, elsewhere)
    link = tmp_path / "rings" / "planted.ring"
    link.symlink_to(elsewhere)
    found = find_sources([tmp_path / "rings"])
    assert [(s.path.name, s.kind) for s in found] == [
        (os.path.basename(w.path), "ring"), ("planted.ring", FOREIGN)]
    assert main(["analyze", str(tmp_path / "rings"), "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["summary"]["records"] == 1 and doc["summary"]["rejected"] == {"not_ours": 1}
    assert out.err.strip() == f"commcheck analyze: skipped {link}: a symlink, not yours " \
                              f"({os.getuid()}): not read"
