"""The C++ DDP hook's build cache (commcheck/native/ddphook.py): ranks of one node starting
together build it once, the others wait and load it; a key names everything it depends on."""

from __future__ import annotations

import threading
import time

from commcheck.native import ddphook


def test_ranks_starting_together_build_once_and_the_rest_load_it(tmp_path, monkeypatch):
    builds, loads = [], []

    def build(name, target, compiler):
        builds.append(name)
        time.sleep(0.3)  # the others reach the lock meanwhile
        target.write_bytes(b"library")
        return "built"

    def load(name, path):
        loads.append(path.read_bytes())
        return "loaded"

    monkeypatch.setattr(ddphook, "_build", build)
    monkeypatch.setattr(ddphook, "_import", load)
    got = []
    ranks = [threading.Thread(target=lambda: got.append(ddphook._cached(tmp_path / "cache",
                                                                        "hook_x", "c++")))
             for _ in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(10)
    assert builds == ["hook_x"] and sorted(got) == ["built"] + ["loaded"] * 3
    assert loads == [b"library"] * 3
    assert ddphook._cached(tmp_path / "cache", "hook_x", "c++") == "loaded"  # a later run
    assert builds == ["hook_x"]


def test_the_key_changes_with_the_compiler_its_flags_and_torchs_build(monkeypatch):
    monkeypatch.setattr(ddphook, "compiler_version", lambda c: b"version of " + c.encode())
    a = ddphook.key("/usr/bin/c++")
    assert a == ddphook.key("/usr/bin/c++") and a != ddphook.key("/usr/bin/clang++")
    monkeypatch.setattr(ddphook, "_torch_build", lambda: b"another torch")
    b = ddphook.key("/usr/bin/c++")
    monkeypatch.setattr(ddphook, "FLAGS", ("-O3",))
    assert len({a, b, ddphook.key("/usr/bin/c++")}) == 3
