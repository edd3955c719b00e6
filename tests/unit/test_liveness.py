"""What the relays see of each rank's process (``Engine.observe``), what a rank is doing
(``Engine.condition``), and stalls reported once per cause (issue 12): rank_died from the
liveness, missing_rank folded per group and missing ranks, hang when every member entered
and not all completed. Hand-made records through both engines (``fast=True`` and the exact
reference)."""

from __future__ import annotations

import json

import pytest

from commcheck.collector import snapshot
from commcheck.engine import Engine
from commcheck.engine.findings import Kind, WaitingIn
from commcheck.engine.stalls import HOLD_S
from commcheck.engine.state import Condition, Liveness, RankState, condition
from commcheck.wire import GOODBYE, PHASE_ENTRY, BatchBuilder, decode, encode

from ..records import WORLD, feed, rec

pytestmark = pytest.mark.timeout(30)
ENGINES = pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
TIMEOUT = 30.0
OTHERS = [0, 1, 3]  # rank 2 is the one in trouble


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


def alive(idle: float = 0.2, **kw) -> Liveness:
    return Liveness(state="alive", idle_s=idle, **kw)


def observe_all(e: Engine, now: float, **special: Liveness) -> None:
    e.observe_many({r: special.get(f"r{r}", alive(pid=1000 + r)) for r in WORLD}, now)


def kinds(findings) -> list[str]:
    return [str(f.kind) for f in findings]


# -- clean ------------------------------------------------------------------------------------


@ENGINES
def test_a_clean_run_with_every_rank_alive_has_no_finding(fast):
    e = engine(fast, upto=8)
    for now in (110.0, 150.0, 500.0):
        observe_all(e, now)
        assert e.check_hangs(now) == []
    assert all(e.condition(r, 500.0).condition == Condition.PROGRESSING for r in WORLD)
    for r in WORLD:
        e.ingest(decode(encode(BatchBuilder("r", r, f"node{r // 2}", 4).control(GOODBYE, 2))))
    observe_all(e, 501.0, **{f"r{r}": Liveness(state="gone", goodbye=True, exit_code=0)
                             for r in WORLD})
    assert e.check_hangs(501.0) == [] and e.finish() == []
    assert all(e.condition(r, 501.0).condition == Condition.FINISHED for r in WORLD)


# -- rank_died --------------------------------------------------------------------------------


@ENGINES
def test_a_rank_killed_after_a_completed_collective_is_one_rank_died(fast):
    """Rank 2 completed seq 4 and was killed; the others wait in seq 5."""
    e = engine(fast)
    for r in OTHERS:
        feed(e, r, [entry(5, 105.0)])
    observe_all(e, 105.5, r2=Liveness(state="gone", signal=9, pid=1002, idle_s=0.4))
    [f] = e.check_hangs(105.6)
    assert (f.kind, f.culprits, f.hosts, f.ambiguous) == (Kind.RANK_DIED, [2], ["node1"], False)
    assert (f.group, f.seq, f.op, f.callsite, f.t) == ("0[0-3]", 4, "all_reduce",
                                                      "train.py:54 step", 105.5)
    d = f.detail
    assert (d.pid, d.exit_code, d.signal) == (1002, None, 9)
    assert (d.last_completed.at, d.last_completed.op, d.last_completed.callsite) == (
        "0[0-3] seq 4", "all_reduce", "train.py:54 step")
    assert d.last_entered is None  # it completed what it entered
    assert d.waiting == [WaitingIn(op="all_reduce", at="0[0-3] seq 5",
                                   callsite="train.py:55 step", ranks=OTHERS)]
    assert d.collectives_left_waiting == 1
    assert e.condition(2, 106.0).condition == Condition.DEAD
    # no missing_rank, then or ever: the death explains seq 5
    assert e.check_hangs(105.6 + 2 * TIMEOUT) == [] and e.finish() == []
    assert e.stats.findings == 1


@ENGINES
def test_a_dead_rank_with_six_open_collectives_is_one_rank_died(fast):
    e = engine(fast)
    for r in OTHERS:  # six collectives issued asynchronously
        feed(e, r, [entry(s, 105.0 + 0.1 * s) for s in range(5, 11)])
    feed(e, 2, [entry(5, 105.0)])  # rank 2 entered seq 5 and died in it
    observe_all(e, 106.0, r2=Liveness(state="gone", exit_code=1))
    [f] = e.check_hangs(106.0)
    assert f.kind == Kind.RANK_DIED and f.culprits == [2] and f.seq == 5
    assert (f.detail.exit_code, f.detail.signal) == (1, None)
    assert f.detail.last_completed.at == "0[0-3] seq 4"
    assert f.detail.last_entered.at == "0[0-3] seq 5"
    assert [w.at for w in f.detail.waiting] == [f"0[0-3] seq {s}" for s in range(5, 11)]
    assert f.detail.collectives_left_waiting == 6
    assert e.check_hangs(200.0) == [] and e.finish() == []


@ENGINES
def test_collectives_entered_after_a_death_count_into_it_at_their_timeout(fast):
    e = engine(fast)
    observe_all(e, 105.0, r2=Liveness(state="gone", signal=11))
    [f] = e.check_hangs(105.0)
    assert f.detail.collectives_left_waiting == 0 and f.detail.waiting == []
    for r in OTHERS:
        feed(e, r, [entry(s, 106.0 + s) for s in range(5, 11)])
    assert e.check_hangs(106.0 + 10 + TIMEOUT) == []
    assert e.deaths[("r", 2)] is f and f.detail.collectives_left_waiting == 6
    assert e.finish() == [] and f.detail.collectives_left_waiting == 6


@ENGINES
def test_a_dead_rank_stuck_inside_a_collective_is_no_hang(fast):
    """Every member entered seq 5; rank 2 died in it: its rank_died says so, no hang."""
    e = engine(fast)
    for r in WORLD:
        feed(e, r, [entry(5, 105.0)])
    observe_all(e, 106.0, r2=Liveness(state="gone", signal=6))
    [f] = e.check_hangs(106.0)
    assert f.kind == Kind.RANK_DIED and f.detail.last_entered.at == "0[0-3] seq 5"
    assert f.detail.waiting[0].ranks == [0, 1, 3] and f.detail.collectives_left_waiting == 1
    assert e.check_hangs(106.0 + TIMEOUT) == [] and e.finish() == []


@ENGINES
def test_a_goodbye_is_no_death(fast):
    e = engine(fast)
    observe_all(e, 105.0, r2=Liveness(state="gone", goodbye=True, exit_code=0))
    assert e.check_hangs(105.0) == []
    # gone without a goodbye in the ring, but its goodbye message arrives before the check
    observe_all(e, 106.0, r3=Liveness(state="gone", exit_code=0))
    e.ingest(decode(encode(BatchBuilder("r", 3, "node1", 4).control(GOODBYE, 2))))
    assert e.check_hangs(106.0) == []


@ENGINES
def test_each_death_is_reported_once_and_a_rank_past_the_seq_is_not_missing(fast):
    """Ranks 2 (dead) and 3 (alive, its record of seq 5 lost: it entered seq 6) never
    enter seq 5: the death, and seq 5 is not verified (rank 3 went past it: never missing
    for it); seq 6, missing rank 2 only, counts into the death."""
    e = engine(fast)
    for r in (0, 1):
        feed(e, r, [entry(5, 105.0)])
    for r in (0, 1, 3):
        feed(e, r, [entry(6, 106.0)])
    observe_all(e, 105.5, r2=Liveness(state="gone", signal=9))
    [died] = e.check_hangs(105.5)
    assert died.kind == Kind.RANK_DIED and died.detail.collectives_left_waiting == 2
    observe_all(e, 150.0, r2=Liveness(state="gone", signal=9))  # still gone: said once
    assert e.check_hangs(150.0) == []
    assert e.dropped.not_verified == 1 and e.dropped.by_rank == {}
    assert e.dropped.lost_by_rank == {3: 1}  # lost, not dropped: it never said so
    assert died.detail.collectives_left_waiting == 2  # seq 5 and 6, counted when it died
    assert e.finish() == []


@ENGINES
def test_a_death_names_a_peer_waiting_in_a_send(fast):
    """Keys of every group of the dead rank wait on it, on either path (a 5-dim shape
    takes the exact path in a fast engine too); the other groups' keys do not."""
    e = engine(fast)
    pair = dict(op="send", ranks=(1, 2), group_name="p2p:1->2", peer=2, numel_out=0)
    feed(e, 1, [entry(0, 106.0, **pair)])
    odd = (1, 1, 1, 1, 100)
    feed(e, 3, [entry(0, 106.2, ranks=(2, 3), group_name="pp", in_shape=odd, out_shape=odd)])
    feed(e, 0, [entry(0, 106.5, ranks=(0, 1), group_name="tp")])  # rank 2 is no member
    if fast:
        assert list(e.open) == [("r", "pp", (2, 3), 0)]
    observe_all(e, 107.0, r2=Liveness(state="gone", signal=9))
    [f] = e.check_hangs(107.0)
    assert [(w.op, w.at, w.ranks) for w in f.detail.waiting] == [
        ("send", "p2p:1->2[1,2] seq 0", [1]), ("all_reduce", "pp[2,3] seq 0", [3])]
    [missing] = e.check_hangs(200.0)  # the tp key, missing live rank 1; not the send
    assert (missing.kind, missing.group, missing.culprits) == (Kind.MISSING_RANK, "tp[0,1]",
                                                              [1])
    assert e.finish() == []


@ENGINES
def test_two_ranks_dying_together_explain_what_they_both_miss(fast):
    """A node dies: ranks 2 and 3 with it. What they both miss counts once into each."""
    e = engine(fast)
    for r in (0, 1):
        feed(e, r, [entry(5, 105.0)])
    observe_all(e, 105.5, r2=Liveness(state="gone", signal=9), r3=Liveness(state="gone",
                                                                             signal=9))
    found = e.check_hangs(105.5)
    assert kinds(found) == ["rank_died", "rank_died"]
    assert [f.culprits for f in found] == [[2], [3]]
    assert [f.detail.collectives_left_waiting for f in found] == [1, 1]
    assert e.check_hangs(200.0) == [] and e.finish() == []


@ENGINES
@pytest.mark.parametrize("together", [True, False], ids=["same-check", "next-check"])
@pytest.mark.parametrize("waiting", [True, False], ids=["waiting", "computing"])
def test_ranks_torn_down_after_a_death_are_its_consequences(fast, together, waiting):
    """Rank 2 is killed after seq 4; the others wait in seq 5, or still compute (they never
    entered it), until torchrun stops them (SIGTERM, no goodbye): one rank_died, for rank
    2, naming them in then_gone."""
    e = engine(fast)
    if waiting:
        for r in OTHERS:
            feed(e, r, [entry(5, 105.0)])
    gone = {f"r{r}": Liveness(state="gone", signal=15, pid=1000 + r) for r in OTHERS}
    killed = Liveness(state="gone", signal=9, pid=1002)
    if together:
        observe_all(e, 105.5, r2=killed, **gone)
        [f] = e.check_hangs(105.6)
    else:
        observe_all(e, 105.5, r2=killed)
        [f] = e.check_hangs(105.6)
        observe_all(e, 106.5, r2=killed, **gone)
        assert e.check_hangs(106.6) == []
    assert (f.kind, f.culprits, f.detail.then_gone) == (Kind.RANK_DIED, [2], OTHERS)
    assert e.check_hangs(300.0) == [] and e.finish() == []
    assert e.stats.findings == 1


@ENGINES
def test_a_death_that_waited_for_nobody_dead_is_its_own_cause(fast):
    """Ranks 0 and 2 die in the same check; rank 0 waited for no dead rank (it had not
    entered seq 5 either): two causes."""
    e = engine(fast)
    for r in (1, 3):
        feed(e, r, [entry(5, 105.0)])
    observe_all(e, 105.5, r0=Liveness(state="gone", signal=9), r2=Liveness(state="gone",
                                                                             signal=9))
    found = e.check_hangs(105.6)
    assert [(f.culprits, f.detail.then_gone) for f in found] == [([0], []), ([2], [])]


@ENGINES
def test_a_run_stopped_together_is_nobodys_death(fast):
    """The job was cancelled (scancel, a time limit: every rank got SIGTERM at once, each
    relay reporting at its own moment): no rank_died, no missing_rank or hang for the
    collective they were stopped in; the ranks are counted stopped, with their signal."""
    e = engine(fast)
    for r in WORLD:
        feed(e, r, [entry(5, 105.0)])
    feed(e, 0, [done(5, 105.1)])
    observe_all(e, 106.0, r0=Liveness(state="gone", signal=15, seen_t=106.0),
                r1=Liveness(state="gone", signal=15, seen_t=106.05),
                r2=alive(), r3=alive())
    assert e.check_hangs(106.1) == []  # held: the others' relays have not reported yet
    observe_all(e, 106.4, r2=Liveness(state="gone", signal=15, seen_t=106.02),
                r3=Liveness(state="gone", signal=15, seen_t=106.3))
    assert e.check_hangs(106.5) == [] and e.check_hangs(107.6) == []
    assert e.stalls.counters() == {f"stopped.{r}": 15 for r in WORLD}
    assert e.finish() == [] and e.stats.findings == 0


@ENGINES
def test_ranks_stopped_while_others_run_on_are_each_their_own_death(fast):
    """Two ranks SIGTERMed together while the other two run on (not a cancelled job): once
    the hold is over, each is its own rank_died."""
    e = engine(fast)
    observe_all(e, 105.5, r0=Liveness(state="gone", signal=15), r2=Liveness(state="gone",
                                                                             signal=15))
    assert e.check_hangs(105.6) == []
    found = e.check_hangs(105.5 + HOLD_S)
    assert [(f.culprits, f.detail.then_gone) for f in found] == [([0], []), ([2], [])]
    assert e.stalls.counters() == {}


@ENGINES
def test_ranks_stopped_after_a_rank_stopped_first_are_its_consequences(fast):
    """Rank 2's pod is evicted (SIGTERM) at 105; torchrun stops the others a second later:
    one rank_died, rank 2's, naming them (not a run stopped together: a second apart)."""
    e = engine(fast)
    observe_all(e, 105.0, r2=Liveness(state="gone", signal=15))
    assert e.check_hangs(105.1) == []
    observe_all(e, 106.0, **{f"r{r}": Liveness(state="gone", signal=15) for r in WORLD})
    [f] = e.check_hangs(105.0 + HOLD_S)
    assert (f.culprits, f.detail.then_gone) == ([2], OTHERS)


@ENGINES
def test_a_rank_stopped_before_another_died_is_not_that_deaths_consequence(fast):
    """Rank 0 was stopped (SIGTERM) a second before rank 2 was SIGKILLed: both reported,
    as soon as the SIGKILL shows the run was not stopped together."""
    e = engine(fast)
    observe_all(e, 105.0, r0=Liveness(state="gone", signal=15))
    assert e.check_hangs(105.1) == []
    observe_all(e, 106.0, r0=Liveness(state="gone", signal=15), r2=Liveness(state="gone",
                                                                              signal=9))
    found = e.check_hangs(106.1)
    assert [(f.culprits, f.detail.then_gone) for f in found] == [([0], []), ([2], [])]


# -- missing_rank, once per cause --------------------------------------------------------------


@ENGINES
def test_a_missing_rank_that_is_alive_is_one_missing_rank_with_later_seqs_folded(fast):
    e = engine(fast)
    for r in OTHERS:
        feed(e, r, [x for s in range(5, 11) for x in [entry(s, 100.0 + s)]])
    observe_all(e, 120.0, r2=alive(idle=15.0))  # records dropped or slow: it is alive
    assert e.check_hangs(120.0) == []
    [f] = e.check_hangs(100.0 + 5 + TIMEOUT)
    assert (f.kind, f.seq, f.culprits, f.hosts) == (Kind.MISSING_RANK, 5, [2], ["node1"])
    assert f.detail.later_collectives == 0
    assert "later_collectives" not in json.dumps(f.to_json())  # omitted while 0
    assert e.check_hangs(200.0) == []
    assert f.detail.later_collectives == 5 and '"later_collectives": 5' in json.dumps(
        f.to_json())
    assert e.onsets[(Kind.MISSING_RANK, "r", "0", WORLD, (2,))].finding is f
    assert e.finish() == [] and e.stats.findings == 1


@ENGINES
def test_another_set_of_missing_ranks_is_another_missing_rank(fast):
    e = engine(fast)
    for r in (0, 1, 3):
        feed(e, r, [entry(5, 105.0)])
    for r in (0, 1):
        feed(e, r, [entry(6, 106.0)])
    found = e.check_hangs(200.0)
    assert [(f.seq, f.culprits) for f in found] == [(5, [2]), (6, [2, 3])]


# -- hang: every member entered, not all completed ---------------------------------------------


def hung(fast: bool) -> Engine:
    """Every member entered seq 5 (the last at 100.3 + 5), none completed."""
    e = engine(fast)
    for r in WORLD:
        feed(e, r, [entry(5, 105.0 + 0.1 * r)])
    return e


@ENGINES
def test_a_hang_names_the_stopped_rank_within_the_hang_timeout(fast):
    e = hung(fast)
    observe_all(e, 106.0, r1=Liveness(state="stopped", idle_s=0.9, pid=1001))
    assert e.check_hangs(105.3 + TIMEOUT - 0.01) == []
    observe_all(e, 135.3, r1=Liveness(state="stopped", idle_s=30.2, pid=1001))
    [f] = e.check_hangs(105.3 + TIMEOUT)
    assert (f.kind, f.seq, f.culprits, f.hosts, f.ambiguous) == (Kind.HANG, 5, [1], ["node0"],
                                                                False)
    assert (f.op, f.callsite, f.t) == ("all_reduce", "train.py:55 step", 105.3)
    d = f.detail
    assert d.not_completed == [0, 1, 2, 3] and d.waited_s == TIMEOUT
    assert [(g.condition, g.ranks, g.at) for g in d.doing] == [
        ("frozen", [1], "0[0-3] seq 5"), ("blocked", [0, 2, 3], "0[0-3] seq 5")]
    assert d.doing[0].idle_s == 30.2
    assert e.check_hangs(500.0) == [] and e.finish() == []


@ENGINES
def test_a_hang_without_liveness_is_ambiguous_and_lists_every_rank(fast):
    e = hung(fast)
    [f] = e.check_hangs(105.3 + TIMEOUT)
    assert (f.kind, f.culprits, f.ambiguous) == (Kind.HANG, [0, 1, 2, 3], True)
    [g] = f.detail.doing
    assert (g.condition, g.ranks, g.op, g.at, g.callsite, g.idle_s) == (
        "blocked", [0, 1, 2, 3], "all_reduce", "0[0-3] seq 5", "train.py:55 step", None)
    # later hung seqs of the group fold into it
    for r in WORLD:
        feed(e, r, [done(5, 105.0), entry(6, 140.0)])
    assert e.check_hangs(140.0 + TIMEOUT) == []
    assert f.detail.later_collectives == 1 and e.finish() == []


@ENGINES
def test_completions_just_before_the_timeout_are_no_hang(fast):
    e = hung(fast)
    assert e.check_hangs(105.3 + TIMEOUT - 0.1) == []
    for r in WORLD:
        feed(e, r, [done(5, 105.0 + 0.1 * r)])
    assert e.check_hangs(105.3 + TIMEOUT) == [] and e.finish() == []
    assert e.stats.verified == 6 and e.unmatched() == 0


@ENGINES
def test_a_hang_on_one_live_rank_that_never_completed_is_ambiguous_on_it(fast):
    """Ranks 0, 1, 3 completed seq 5; rank 2, alive, never did and has written nothing
    since. It is blocked in seq 5 (not frozen: it is inside a collective), so liveness
    singles nobody out: the hang names rank 2, ambiguous."""
    e = hung(fast)
    for r in OTHERS:
        feed(e, r, [done(5, 105.0 + 0.1 * r)])
    observe_all(e, 140.0, r2=alive(idle=34.0))
    [f] = e.check_hangs(105.3 + TIMEOUT)
    assert (f.culprits, f.ambiguous, f.detail.not_completed) == ([2], True, [2])
    assert [(g.condition, g.ranks) for g in f.detail.doing] == [("blocked", [2]),
                                                              ("progressing", [0, 1, 3])]


@ENGINES
def test_a_rank_silent_outside_any_collective_is_frozen_and_named(fast):
    """Rank 0 completed seq 5 and has written nothing for longer than the hang timeout
    while not in a collective: frozen, the hang's culprit."""
    e = hung(fast)
    feed(e, 0, [done(5, 105.0)])
    observe_all(e, 136.0, r0=alive(idle=31.0))
    assert e.condition(0, 136.0).condition == Condition.FROZEN
    [f] = e.check_hangs(136.0)
    assert (f.culprits, f.ambiguous, f.detail.not_completed) == ([0], False, [1, 2, 3])


@ENGINES
def test_the_end_of_a_run_reports_open_hangs_without_a_wait(fast):
    e = hung(fast)
    [f] = e.finish()
    assert f.kind == Kind.HANG and f.detail.waited_s is None and f.ambiguous


@ENGINES
def test_members_that_disagree_are_a_desync_not_a_hang(fast):
    e = engine(fast)
    for r in WORLD:
        feed(e, r, [entry(5, 105.0, numel_in=99 if r == 2 else 100)])
    assert e.check_hangs(200.0) == [] and e.finish() == []


# -- conditions -------------------------------------------------------------------------------


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
    assert e.ranks[0].last_done.at == "0[0-3] seq 4" and e.ranks[0].last_done.t_done == 104.01


def test_a_rank_heard_of_only_by_its_relay_is_reported_on_its_host():
    e = engine(True)
    e.observe(7, Liveness(state="gone", signal=9, host="node3"), 110.0)
    [f] = e.check_hangs(110.0)
    assert (f.kind, f.culprits, f.hosts, f.run, f.seq) == (Kind.RANK_DIED, [7], ["node3"],
                                                           "r", -1)
    assert f.detail.last_completed is None and f.detail.waiting == []


# -- snapshots --------------------------------------------------------------------------------


@ENGINES
def test_liveness_survives_a_snapshot(fast):
    e = engine(fast)
    e.observe(1, Liveness(state="stopped", pid=1001), 105.5)
    e.observe_many({2: Liveness(state="alive", idle_s=3.0, seen_t=105.0)}, 105.5)
    e = snapshot.load(snapshot.dump(e))
    assert e.ranks[1].liveness == Liveness(state="stopped", pid=1001, seen_t=105.5)
    assert e.ranks[2].liveness.idle_at(106.0) == 4.0
    assert e.ranks[2].last_done.at == e.ranks[2].last.at == "0[0-3] seq 4"
    assert e.condition(1, 106.0).condition == Condition.FROZEN


@ENGINES
def test_liveness_survives_a_snapshot_and_deaths_are_reported_once(fast):
    e = engine(fast)
    for r in OTHERS:
        feed(e, r, [entry(5, 105.0)])
    observe_all(e, 105.5, r1=Liveness(state="stopped", pid=1001),
                r2=Liveness(state="gone", signal=9, pid=1002))
    e = snapshot.load(snapshot.dump(e))  # the death is seen, not reported yet
    assert e.ranks[1].liveness == Liveness(state="stopped", pid=1001, seen_t=105.5)
    assert e.ranks[2].last_done.at == "0[0-3] seq 4" and e.ranks[2].last.at == "0[0-3] seq 4"
    [f] = e.check_hangs(106.0)
    assert f.kind == Kind.RANK_DIED and f.detail.collectives_left_waiting == 1
    e = snapshot.load(snapshot.dump(e))
    observe_all(e, 107.0, r2=Liveness(state="gone", signal=9, pid=1002))
    assert e.check_hangs(200.0) == [] and e.finish() == []
    assert e.deaths[("r", 2)].detail.waiting == f.detail.waiting


# -- the report's line ---------------------------------------------------------------------------


@ENGINES
def test_a_world_hang_reads_as_one_short_line(fast):
    """64 ranks in one all_reduce, rank 17 stopped: the report names it, and the rest as
    one span."""
    from commcheck.collector.report import _how_far

    world = tuple(range(64))
    e = Engine(64, hang_timeout=TIMEOUT, fast=fast)
    for r in world:
        b = BatchBuilder("r", r, f"node{r // 8}", 64)
        e.ingest(decode(encode(b.build([entry(0, 100.0, ranks=world)], seq=1))))
    e.observe(17, Liveness(state="stopped", idle_s=1.0), 101.0)
    [f] = e.check_hangs(130.0)
    assert (f.kind, f.culprits, f.hosts, f.ambiguous) == (Kind.HANG, [17], ["node2"], False)
    assert _how_far(f) == ("ranks 0-63 never completed, for 30.0 s: rank 17 frozen in "
                           "all_reduce 0[0-63] seq 0 (idle 30.0 s); ranks 0-16,18-63 "
                           "blocked in all_reduce 0[0-63] seq 0")
