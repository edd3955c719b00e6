"""Issue 18 item 5: a member whose call raised (a peer died under it) is "crashed" with the
error it raised, never "waiting"; members that said nothing of the kind still wait."""

from __future__ import annotations

import msgspec
import pytest

from commcheck.collector.report import _how_far
from commcheck.engine import Engine
from commcheck.engine.state import Liveness
from commcheck.wire import (
    GOODBYE,
    PHASE_ENTRY,
    RECORDS,
    BatchBuilder,
    CallFailure,
    Ending,
    WireError,
    decode,
    encode,
)

from ..records import WORLD, feed, rec

pytestmark = pytest.mark.timeout(30)

CLOSED = "RuntimeError: Connection closed by peer [127.0.0.1]:29500"


def _entry(seq: int = 0, **kw):
    return rec(seq=seq, phase=PHASE_ENTRY, flags=0, **kw)


def _failed(engine: Engine, rank: int, seq: int = 0, error: str = CLOSED):
    """What a rank's relay sends for a K_FAILED ring entry: a records message without
    records, carrying the failure."""
    env = BatchBuilder("r", rank, f"node{rank // 2}", 4).build([], seq=2)
    env.failed = [CallFailure("0", list(WORLD), seq, "all_reduce", error)]
    return engine.ingest(decode(encode(env)))


def test_a_failure_travels_as_an_optional_field():
    """Old decoders ignore the field (msgspec drops unknown keys); a failure naming a group
    its sender is not in, or an overlong error, is refused."""
    env = BatchBuilder("r", 1, "h", 4).build([], seq=2)
    env.failed = [CallFailure("0", [0, 1, 2, 3], 5, "all_reduce", CLOSED)]
    data = encode(env)
    assert decode(data).env.failed == env.failed

    class Old(msgspec.Struct):
        v: int
        kind: str
        rank: int

    assert msgspec.msgpack.decode(data, type=Old) == Old(1, RECORDS, 1)
    assert decode(encode(BatchBuilder("r", 1, "h", 4).build([], seq=3))).env.failed == []
    for bad in (CallFailure("0", [0, 2], 5, "all_reduce", CLOSED),
                CallFailure("0", [0, 1], 5, "all_reduce", "x" * 1000)):
        env.failed = [bad]
        with pytest.raises(WireError, match="failure"):
            decode(encode(env))


@pytest.mark.parametrize("fast", [True, False])
def test_missing_rank_says_waiting_of_survivors_that_raised_nothing(fast):
    """Clean: ranks 0-2 entered, rank 3 never did, nobody raised: all three wait."""
    engine = Engine(4, hang_timeout=30, fast=fast)
    for r in (0, 1, 2):
        feed(engine, r, [_entry(t_enter=100.0)])
        engine.observe(r, Liveness(state="alive", idle_s=1.0, seen_t=130.0), 130.0)
    [missing] = [f for f in engine.check_hangs(now=131.0) if f.kind == "missing_rank"]
    assert missing.detail.crashed == {} and missing.detail.not_waiting == {}
    assert _how_far(missing).startswith("ranks 0,1,2 waiting for 31.0 s; ")


@pytest.mark.parametrize("fast", [True, False])
def test_missing_rank_says_crashed_with_the_error_of_survivors_that_raised(fast):
    """Faulty: ranks 0 and 1 raised gloo's "Connection closed by peer" in the collective
    rank 3 never entered; rank 2 still waits."""
    engine = Engine(4, hang_timeout=30, fast=fast)
    for r in (0, 1, 2):
        feed(engine, r, [_entry(t_enter=100.0)])
        engine.observe(r, Liveness(state="alive", idle_s=1.0, seen_t=130.0), 130.0)
    _failed(engine, 0)
    _failed(engine, 1)
    [missing] = [f for f in engine.check_hangs(now=131.0) if f.kind == "missing_rank"]
    assert missing.detail.crashed == {"0": CLOSED, "1": CLOSED}
    assert missing.detail.not_waiting == {"0": "crashed", "1": "crashed"}
    assert _how_far(missing).startswith(
        f"rank 2 waiting for 31.0 s; ranks 0,1 crashed in it: {CLOSED}; ")
    assert msgspec.json.decode(msgspec.json.encode(missing))["detail"]["crashed"] == \
        {"0": CLOSED, "1": CLOSED}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("raised", [False, True])
def test_rank_died_says_which_survivors_crashed(fast, raised):
    """Rank 3 died inside seq 0; ranks 0-2 entered it. Clean: they wait in it. Faulty:
    ranks 0,1 raised there, so only rank 2 waits."""
    engine = Engine(4, hang_timeout=30, fast=fast)
    for r in WORLD:
        feed(engine, r, [_entry(t_enter=100.0)])
    if raised:
        _failed(engine, 0)
        _failed(engine, 1)
    engine.observe(3, Liveness(state="gone", signal=9, seen_t=101.0), 101.0)
    [died] = [f for f in engine.check_hangs(now=102.0) if f.kind == "rank_died"]
    [w] = died.detail.waiting
    assert w.ranks == [0, 1, 2]
    text = _how_far(died)
    if raised:
        assert w.crashed == {"0": CLOSED, "1": CLOSED}
        assert f"rank 2 wait in all_reduce 0[0-3] seq 0; ranks 0,1 crashed in all_reduce " \
            f"0[0-3] seq 0: {CLOSED}" in text
    else:
        assert w.crashed == {}
        assert "ranks 0-2 wait in all_reduce 0[0-3] seq 0" in text and "crashed" not in text


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("raised", [False, True])
def test_hang_says_crashed_with_the_error_for_members_that_raised(fast, raised):
    """Every member entered seq 0, none completed; faulty: rank 1 raised (a timeout)."""
    timeout = "RuntimeError: Timed out waiting 1800000ms for recv operation to complete"
    engine = Engine(4, hang_timeout=30, fast=fast)
    for r in WORLD:
        feed(engine, r, [_entry(t_enter=100.0)])
    if raised:
        _failed(engine, 1, error=timeout)
    [hang] = [f for f in engine.check_hangs(now=131.0) if f.kind == "hang"]
    crashed = [(d.ranks, d.error) for d in hang.detail.doing if d.condition == "crashed"]
    text = _how_far(hang)
    if raised:
        assert crashed == [([1], timeout)]
        assert hang.detail.doing[0].condition == "crashed"
        assert f"rank 1 crashed in all_reduce 0[0-3] seq 0: {timeout}" in text
    else:
        assert crashed == [] and "crashed" not in text


def test_the_error_is_its_type_and_first_line_without_the_backends_source_location():
    from commcheck.rank.session import error_text
    from commcheck.wire import MAX_ERROR_LEN

    assert error_text(ValueError("bad\nmore")) == "ValueError: bad"
    assert error_text(TimeoutError()) == "TimeoutError"
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                        "Connection closed by peer [127.0.0.1]:40373. " + "x" * 300)
    text = error_text(gloo)
    assert text.startswith("RuntimeError: Connection closed by peer [127.0.0.1]:40373. ")
    assert len(text) == MAX_ERROR_LEN and text.endswith("…")


def test_errors_differing_only_in_numbers_are_said_once():
    from commcheck.collector.report import _crashes

    same = {"0": CLOSED, "1": CLOSED}
    assert _crashes(same, " in it") == [f"ranks 0,1 crashed in it: {CLOSED}"]
    ports = {"1": "RuntimeError: Connection closed by peer [127.0.0.1]:9. Check the logs",
             "0": "RuntimeError: Connection closed by peer [127.0.0.1]:8. Check the logs",
             "2": "ValueError: other"}
    assert _crashes(ports) == [
        "ranks 0,1 crashed: RuntimeError: Connection closed by peer [127.0.0.1]:8 (rank 0's; "
        "alike for the others)", "rank 2 crashed: ValueError: other"]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("inside_s", [0.2, 45.0])
def test_a_run_that_ends_inside_a_call_is_no_hang_unless_it_hung_there_first(fast, inside_s):
    """Ctrl-C (or a cancelled job) reaches every rank inside the same all_reduce: each
    says goodbye 0.2 s after entering it; nobody hung, the call is not verified
    (unmatched), no finding. The same goodbyes 45 s after the entry (hang timeout 30 s):
    they sat in it first, so it is a hang."""
    engine = Engine(4, hang_timeout=30, fast=fast)
    for r in WORLD:
        feed(engine, r, [_entry(t_enter=100.0)])
    for r in WORLD:
        _goodbye(engine, r, 100.0 + inside_s)
    found = engine.finish()
    if inside_s < 30:
        assert found == [] and engine.unmatched() == 1
    else:
        assert [(f.kind, f.culprits) for f in found] == [("hang", list(WORLD))]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("fault", ["", "raised", "exception"])
def test_ctrl_c_between_calls_on_some_ranks_is_no_missing_rank(fast, fault):
    """Ctrl-C reaches ranks 0 and 1 between calls and ranks 2 and 3 inside seq 0: all
    stop within 0.2 s; no finding. If rank 2's call had raised (a peer gone, a timeout), or
    rank 0 had ended by an exception of its own (the others torn down for it), the missing
    ranks stay named."""
    engine = Engine(4, hang_timeout=30, fast=fast)
    for r in (2, 3):
        feed(engine, r, [_entry(t_enter=100.0)])
    if fault == "raised":
        _failed(engine, 2)
    for r in WORLD:
        _goodbye(engine, r, 100.2, exception=fault == "exception" and r == 0)
    found = engine.finish()
    if fault:
        assert [(f.kind, f.culprits) for f in found] == [("missing_rank", [0, 1])]
    else:
        assert found == [] and engine.unmatched() == 1


def _goodbye(engine: Engine, rank: int, t: float, exception: bool = False) -> None:
    """A goodbye as a rank says it when Ctrl-C stops it (KeyboardInterrupt, SIGINT), or
    when an exception of its own ends it."""
    env = BatchBuilder("r", rank, f"node{rank // 2}", 4).control(GOODBYE, 3, t, 1)
    env.ending = Ending("exception", error="ValueError: bad batch") if exception else \
        Ending("exception", signal=2, error="KeyboardInterrupt")
    engine.ingest(decode(encode(env)))
