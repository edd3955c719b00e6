"""How a run ended, and how much of it was verified (issue 29 parts 1 and 2): the goodbye
carries how the process is ending (an uncaught exception, the exit status, a stop signal)
through the ring and the wire, the report says "training failed on ranks ..." with status
4, and a run mostly unverified says its share in the first line and exits 5 above the
limit. Real rings, a real database, the real report."""

from __future__ import annotations

import io
import sys

import pytest
from rich.console import Console

from commcheck.collector.report import build_summary, exit_status, render
from commcheck.collector.store import Store
from commcheck.engine import RankState
from commcheck.rank import ending as ending_mod
from commcheck.wire import GOODBYE, WIRE_VERSION, Ending, Envelope, WireError, decode, encode

from .test_ring import FakeLink, channel, close, drain, put, writer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def watched(monkeypatch):
    monkeypatch.delattr(sys, "last_value", raising=False)  # pytest sets it on a failure
    ending_mod.watch()
    try:
        yield ending_mod
    finally:
        ending_mod.unwatch()
        ending_mod._Seen.error, ending_mod._Seen.code, ending_mod._Seen.thread = "", None, ""


def test_an_uncaught_exception_rides_the_goodbye_with_its_counters(tmp_path, watched, capsys):
    w = writer(tmp_path)
    link = FakeLink()
    ch = channel(w, link)
    put(w, 0, 3)
    sys.excepthook(RuntimeError, RuntimeError("CUDA error: an illegal memory access\nmore"),
                   None)
    assert "CUDA error" in capsys.readouterr().err  # the previous hook still ran
    w.counters["not_checked"] = 2
    w.at_exit = True
    close(w, ch, linger=0.3)  # a fake link acknowledges nothing
    drain(ch, 3)
    ch.close(remove=False)
    bye = link.envelopes()[-1]
    assert bye.kind == GOODBYE and bye.counters["not_checked"] == 2
    assert bye.counters["records"] == 3
    assert bye.ending == Ending(how="exception",
                                error="RuntimeError: CUDA error: an illegal memory access")
    assert bye.ending.failed


def test_exit_status_signal_and_a_finally_are_told(watched):
    assert ending_mod.ending(at_exit=True) == Ending(how="exit")  # the script's end
    assert not ending_mod.ending(at_exit=True).failed
    assert ending_mod.ending(at_exit=False) == Ending(how="exit")  # destroy: not known yet
    assert ending_mod.ending(at_exit=True, signal=15) == Ending(how="signal", signal=15)
    try:
        raise ValueError("bad batch")
    except ValueError:  # what destroy_process_group in a finally sees on the way up
        assert ending_mod.ending(at_exit=False) == Ending(how="exception",
                                                          error="ValueError: bad batch")
    with pytest.raises(SystemExit):
        sys.exit(3)
    assert ending_mod.ending(at_exit=True) == Ending(how="exit", code=3)


def test_an_exception_printed_by_a_hook_set_later_is_still_the_ending(watched,
                                                                     monkeypatch):
    """Another excepthook replaced commcheck's after patch(): Python still leaves the
    exception it printed in sys.last_value before the exit handlers run."""
    monkeypatch.setattr(sys, "last_value", KeyError("step"), raising=False)
    assert ending_mod.ending(at_exit=True) == Ending(how="exception", error="KeyError: 'step'")


def test_unwatch_puts_the_hooks_back():
    before = (sys.excepthook, sys.exit)
    ending_mod.watch()
    assert sys.excepthook is not before[0] and sys.exit is not before[1]
    ending_mod.unwatch()
    assert (sys.excepthook, sys.exit) == before


def _goodbye(**kw) -> bytes:
    return encode(Envelope(v=WIRE_VERSION, kind=GOODBYE, run="r", rank=0, host="h", seq=1,
                           **kw))


def test_the_wire_takes_an_ending_only_on_a_goodbye_and_only_a_valid_one():
    assert decode(_goodbye()).env.ending is None  # an older rank's goodbye
    assert decode(_goodbye(ending=Ending("exit", 0))).env.ending == Ending("exit", 0)
    for bad in (Ending("crashed"), Ending("exit", 300), Ending("exception", error="x" * 201)):
        with pytest.raises(WireError) as e:
            decode(_goodbye(ending=bad))
        assert e.value.reason == "bad_ending"
    env = Envelope(v=WIRE_VERSION, kind="records", run="r", rank=0, host="h", seq=1,
                   ending=Ending("exit"))
    with pytest.raises(WireError, match="invalid ending"):
        decode(encode(env))


@pytest.fixture
def make_store(tmp_path):
    """A database holding the ranks' endings and counters, closed after the test (its
    records-file writer is a thread)."""
    made: list[Store] = []

    def make(endings: dict[int, tuple | None], counters: dict[str, int]) -> Store:
        made.append(_store(tmp_path, endings, counters))
        return made[-1]

    yield make
    for store in made:
        store.close()


def _store(tmp_path, endings: dict[int, tuple | None], counters: dict[str, int]) -> Store:
    store = Store.create(tmp_path / "run.db")
    ranks = {r: RankState(host=f"node{r}", hello=True, goodbye=True, run="r", ending=e)
             for r, e in endings.items()}
    store.set_ranks(ranks)
    store.set_counters({"world": len(endings), **counters})
    store.commit()
    return store


def _report(store: Store, max_unverified: float = 0.1) -> tuple[int, list[str]]:
    summary = build_summary([], store.summary())
    out = io.StringIO()
    render([], summary, Console(file=out, width=300), max_unverified)
    return exit_status([], summary, max_unverified), out.getvalue().splitlines()


def test_a_run_that_failed_on_every_rank_does_not_read_clean(make_store):
    err = "RuntimeError: rank {} hit a bad shape"
    store = make_store({r: ("exception", -1, 0, err.format(r), "") for r in range(3)} |
                   {3: ("exit", 2, 0, "", "thread loader: OSError: disk")}, {"verified": 5})
    code, lines = _report(store)
    assert code == 4
    assert "training failed on ranks 0-2: RuntimeError: rank 0 hit a bad shape (rank 0's; "\
           "alike for the others)" in lines
    assert "training failed on rank 3: exit status 2" in lines
    assert "  ! rank 3: a thread ended by an exception, the process went on: thread loader: "\
           "OSError: disk" in lines


def test_a_clean_ending_and_an_older_goodbye_read_clean(make_store):
    store = make_store({0: ("exit", 0, 0, "", ""), 1: None}, {"verified": 5,
                                                                  "records": 10})
    summary = build_summary([], store.summary())
    assert summary.failed == [] and exit_status([], summary) in (0, 3)  # 3: no records kept


def test_mostly_unverified_says_its_share_first_and_exits_5(make_store):
    store = make_store({0: ("exit", 0, 0, "", ""), 1: ("exit", 0, 0, "", "")},
                   {"verified": 211, "not_verified": 543, "not_verified.0": 543})
    summary = build_summary([], store.summary())
    assert summary.unverified_share == 0.7202
    summary.records = 1508  # the records themselves are not under test here
    out = io.StringIO()
    render([], summary, Console(file=out, width=300))
    lines = out.getvalue().splitlines()
    assert lines[0] == ("commcheck report: 1508 records from 2 ranks, 211 collectives "
                        "verified, 543 not verified (72% unverified)")
    assert lines[-1] == ("too little verified to call it clean: 72% of the collectives not "
                         "verified (records dropped; the limit is 10%, --max-unverified)")
    assert exit_status([], summary) == 5
    assert exit_status([], summary, max_unverified=0.75) == 0
    summary.not_verified, summary.unverified_share = 2, 0.0094
    assert exit_status([], summary) == 0
