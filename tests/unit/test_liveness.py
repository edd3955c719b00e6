"""What the relays see of each rank's process (``Engine.observe``) and what a rank is doing
(``Engine.condition``), on hand-made records through both engines."""

from __future__ import annotations

import pytest

from commcheck.collector import snapshot
from commcheck.engine import Engine
from commcheck.engine.state import Condition, Liveness, RankState, condition
from commcheck.wire import PHASE_ENTRY

from ..records import WORLD, feed, rec

pytestmark = pytest.mark.timeout(30)
ENGINES = pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
TIMEOUT = 30.0


def entry(seq: int, t: float, **kw):
    return rec(seq=seq, phase=PHASE_ENTRY, flags=0, t_enter=t,
               callsite=f"train.py:{50 + seq} step", **kw)


def done(seq: int, t: float, **kw):
    return rec(seq=seq, t_enter=t, t_done=t + 0.01, callsite=f"train.py:{50 + seq} step", **kw)


def both(seq: int, t: float) -> list:
    return [entry(seq, t), done(seq, t)]


def engine(fast: bool, upto: int = 5) -> Engine:
    """Every rank entered and completed seqs 0 .. upto-1, at t = 100 + seq."""
    e = Engine(4, hang_timeout=TIMEOUT, fast=fast)
    for r in WORLD:
        assert feed(e, r, [x for s in range(upto) for x in both(s, 100.0 + s)]) == []
    return e


def test_condition_precedence():
    s = RankState("h")
    assert condition(s, 10.0, 30.0, blocked=False) == Condition.PROGRESSING
    assert condition(s, 10.0, 30.0, blocked=True) == Condition.BLOCKED
    s.liveness = Liveness(state="alive", idle_s=29.0, seen_t=10.0)
    assert condition(s, 10.0, 30.0, blocked=False) == Condition.PROGRESSING
    assert condition(s, 11.0, 30.0, blocked=False) == Condition.FROZEN  # idle grows
    assert condition(s, 11.0, 30.0, blocked=True) == Condition.BLOCKED  # waiting, not frozen
    s.liveness = Liveness(state="stopped", seen_t=10.0)
    assert condition(s, 10.0, 30.0, blocked=True) == Condition.FROZEN
    s.liveness = Liveness(state="gone", signal=9, seen_t=10.0)
    assert condition(s, 10.0, 30.0, blocked=True) == Condition.DEAD
    s.liveness = Liveness(state="gone", goodbye=True, seen_t=10.0)
    assert condition(s, 10.0, 30.0, blocked=False) == Condition.FINISHED


@ENGINES
def test_engine_condition_says_where_a_rank_is_blocked(fast):
    e = engine(fast)
    feed(e, 1, [entry(5, 105.0)])
    c = e.condition(1, 110.0)
    assert (c.condition, c.last.at, c.blocked_since, c.idle_s) == (
        Condition.BLOCKED, "0[0-3] seq 5", 105.0, None)
    c = e.condition(0, 110.0)
    assert (c.condition, c.last.at, c.blocked_since) == (Condition.PROGRESSING,
                                                         "0[0-3] seq 4", None)
    assert e.ranks[0].done.at == "0[0-3] seq 4" and e.ranks[0].done.t_done == 104.01


@ENGINES
def test_liveness_survives_a_snapshot(fast):
    e = engine(fast)
    e.observe(1, Liveness(state="stopped", pid=1001), 105.5)
    e.observe_many({2: Liveness(state="alive", idle_s=3.0, seen_t=105.0)}, 105.5)
    e = snapshot.load(snapshot.dump(e))
    assert e.ranks[1].liveness == Liveness(state="stopped", pid=1001, seen_t=105.5)
    assert e.ranks[2].liveness.idle_at(106.0) == 4.0
    assert e.ranks[2].done.at == e.ranks[2].last.at == "0[0-3] seq 4"
    assert e.condition(1, 106.0).condition == Condition.FROZEN
