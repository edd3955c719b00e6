"""A rank started by ``commcheck run`` waits at its bootstrap until the launcher releases
it (the node's relay is up), for at most the bound the launcher gives, then goes on."""

from __future__ import annotations

import threading
import time

import pytest

from commcheck.rank import boot

pytestmark = pytest.mark.timeout(30)


def test_a_released_rank_goes_on_at_once(tmp_path, capsys):
    release = tmp_path / "release"
    release.touch()
    t0 = time.monotonic()
    boot._held(f"30.0:{release}")
    assert time.monotonic() - t0 < 5 and capsys.readouterr().err == ""


def test_a_rank_waits_for_the_release(tmp_path, capsys):
    release = tmp_path / "release"
    waited = threading.Event()

    def rank() -> None:
        boot._held(f"30.0:{release}")
        waited.set()

    t = threading.Thread(target=rank)
    t.start()
    assert not waited.wait(0.3)  # held while there is no release file
    release.touch()
    t.join(10)
    assert waited.is_set() and capsys.readouterr().err == ""


def test_past_the_bound_a_rank_goes_on_with_one_line(tmp_path, capsys):
    boot._held(f"0.05:{tmp_path / 'never'}")
    assert capsys.readouterr().err.strip() == ("commcheck: the launcher did not release this "
                                               "rank within 0.05 s; it starts anyway")


def test_no_hold_or_a_bad_one_never_waits(capsys):
    boot._held("")
    boot._held("soon:/nowhere")
    assert capsys.readouterr().err == ""
