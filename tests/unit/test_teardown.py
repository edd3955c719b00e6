"""A launcher's teardown gets no false cause (issue 29 part 3): ranks signalled together are
never each other's cause, a frozen rank waited for nobody, and the ranks a teardown stops
after a hang or a missing_rank are that stall's consequences (``then_gone``), not deaths of
their own. Hand-made records through both engines."""

from __future__ import annotations

import pytest

from commcheck.collector.report import _how_far
from commcheck.engine.findings import Kind
from commcheck.engine.state import Liveness

from .test_liveness import ENGINES, TIMEOUT, done, engine, entry, feed, hung, observe_all

pytestmark = pytest.mark.timeout(30)


def gone(sig: int, t: float, rank: int) -> Liveness:
    return Liveness(state="gone", signal=sig, pid=1000 + rank, seen_t=t)


@ENGINES
def test_ranks_signalled_together_around_a_frozen_rank_are_never_each_others_cause(fast):
    """Rank 2 froze inside seq 5, the others blocked in it; the job is cancelled before any
    hang is reported: SIGTERM to 0, 1, 3 within a millisecond, rank 2 SIGKILLed after the
    grace period. Each is its own rank_died: rank 0 "took down" nobody."""
    e = engine(fast)
    for r in (0, 1, 2, 3):
        feed(e, r, [entry(5, 105.0)])
    observe_all(e, 106.0, r2=Liveness(state="stopped", idle_s=1.0, pid=1002))
    assert e.check_hangs(106.1) == []
    observe_all(e, 110.0, r0=gone(15, 110.0, 0), r1=gone(15, 110.0005, 1),
                r3=gone(15, 110.001, 3), r2=Liveness(state="stopped", pid=1002))
    observe_all(e, 110.5, r0=gone(15, 110.0, 0), r1=gone(15, 110.0005, 1),
                r3=gone(15, 110.001, 3), r2=gone(9, 110.5, 2))
    found = e.check_hangs(110.6)
    assert [(f.kind, f.culprits, f.detail.then_gone) for f in found] == [
        (Kind.RANK_DIED, [r], []) for r in (0, 1, 2, 3)]


@ENGINES
def test_the_teardown_after_a_hang_is_the_hangs_consequence(fast):
    """The hang names frozen rank 1; then the launcher stops everyone (SIGTERM) and kills
    rank 1 (SIGKILL): no rank_died, the hang names them all in then_gone; a rank outside
    the hang that dies by itself later is still its own rank_died."""
    e = hung(fast)
    observe_all(e, 135.3, r1=Liveness(state="stopped", idle_s=30.2, pid=1001))
    [hang] = e.check_hangs(105.3 + TIMEOUT)
    assert (hang.kind, hang.culprits) == (Kind.HANG, [1])
    deaths = {f"r{r}": gone(15, 160.0, r) for r in (0, 2, 3)}
    observe_all(e, 160.0, r1=gone(9, 160.4, 1), **deaths)
    assert e.check_hangs(160.5) == []
    assert hang.detail.then_gone == [0, 1, 2, 3]
    assert _how_far(hang).endswith("; then ranks 0-3 gone (torn down after it: its "
                                   "consequences)"), _how_far(hang)
    assert e.check_hangs(500.0) == [] and e.finish() == []
    assert e.stats.findings == 1


@ENGINES
def test_a_rank_outside_a_hang_killed_afterwards_is_its_own_death(fast):
    """A hang in group (0, 1); rank 3, not in it, is SIGKILLed (the OOM killer) later:
    that death is not the hang's."""
    e = engine(fast)
    pair = (0, 1)
    for r in pair:
        feed(e, r, [entry(0, 105.0, ranks=pair, group_name="tp")])
    observe_all(e, 135.3, r1=Liveness(state="stopped", idle_s=30.2, pid=1001))
    [hang] = e.check_hangs(105.0 + TIMEOUT + 0.1)
    observe_all(e, 150.0, r1=Liveness(state="stopped", pid=1001), r3=gone(9, 150.0, 3))
    [died] = e.check_hangs(150.1)
    assert (died.kind, died.culprits, hang.detail.then_gone) == (Kind.RANK_DIED, [3], [])


@ENGINES
def test_a_hang_that_resolved_explains_no_later_death(fast):
    """A hang naming frozen rank 1 resolves (rank 1 is continued and every member
    completes); a SIGKILL of rank 1 much later is its own rank_died, not the hang's."""
    e = hung(fast)
    observe_all(e, 135.3, r1=Liveness(state="stopped", idle_s=30.2, pid=1001))
    [hang] = e.check_hangs(105.3 + TIMEOUT)
    for r in (0, 1, 2, 3):
        feed(e, r, [done(5, 105.0 + 0.1 * r)])
    observe_all(e, 200.0, r1=gone(9, 200.0, 1))
    [died] = e.check_hangs(200.1)
    assert (died.kind, died.culprits, hang.detail.then_gone) == (Kind.RANK_DIED, [1], [])
