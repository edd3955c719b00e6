"""Dropped is never missing (issue 18 item 2): a rank says which records its full ring
dropped (``Envelope.drops``, written by the rank as a ``K_DROPS`` ring entry); the engine
marks those collectives "not verified" and never reports a member that dropped them as
missing or hung. Both engines (fast and exact), and the rank's bookkeeping."""

from __future__ import annotations

import pytest

from commcheck.engine import Engine
from commcheck.engine.drops import Intervals
from commcheck.engine.findings import Kind
from commcheck.rank.drops import MAX_RANGES, DropBook
from commcheck.wire import (
    GOODBYE,
    PHASE_COMPLETE,
    PHASE_ENTRY,
    BatchBuilder,
    DropRange,
    WireError,
    decode,
    encode,
)

from ..records import WORLD, feed, rec

pytestmark = pytest.mark.timeout(30)
ENGINES = pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])


def entry(seq: int, t: float):
    return rec(seq=seq, phase=PHASE_ENTRY, flags=0, t_enter=t, callsite="train.py:5 step")


def done(seq: int, t: float):
    return rec(seq=seq, t_enter=t, t_done=t + 0.01, callsite="train.py:5 step")


def drops_message(rank: int, *ranges: tuple[int, int, int]) -> bytes:
    """A records message without records, carrying (phase, first, last) ranges of group 0."""
    env = BatchBuilder("r", rank, f"node{rank // 2}", 4).build([], 7)
    env.drops = [DropRange("0", list(WORLD), phase, lo, hi) for phase, lo, hi in ranges]
    return encode(env)


def goodbye(e: Engine, rank: int) -> None:
    e.ingest(decode(encode(BatchBuilder("r", rank, f"node{rank // 2}", 4).control(GOODBYE, 9))))


def run(e: Engine, upto: int, lost: dict[int, set[int]] | None = None) -> None:
    """Every rank enters and completes seqs 0 .. upto-1, less the records in ``lost``
    (rank -> seqs whose entry and completion it dropped)."""
    lost = lost or {}
    for r in WORLD:
        recs = [x for s in range(upto) if s not in lost.get(r, ())
                for x in (entry(s, 100.0 + s), done(s, 100.0 + s))]
        assert feed(e, r, recs) == []


@ENGINES
def test_a_clean_run_has_nothing_unverified(fast):
    e = Engine(4, hang_timeout=30.0, fast=fast)
    run(e, 10)
    for r in WORLD:
        goodbye(e, r)
    assert e.check_hangs(200.0) == [] and e.finish() == []
    assert e.dropped.not_verified == 0 and e.dropped.counters() == {}
    assert e.stats.verified == 10


@ENGINES
def test_dropped_records_are_not_verified_never_missing(fast):
    """Ranks 0, 1 and 3 dropped seqs 4, 3..5 and 4..8 (both phases), rank 2 its last one,
    9 (no later record excuses it: only its word does): none of it is a finding, each
    collective is counted once."""
    e = Engine(4, hang_timeout=30.0, fast=fast)
    lost = {1: {3, 4, 5}, 3: {4, 5, 6, 7, 8}, 0: {4}, 2: {9}}
    run(e, 10, lost)
    e.ingest(decode(drops_message(0, (PHASE_ENTRY, 4, 4), (PHASE_COMPLETE, 4, 4))))
    e.ingest(decode(drops_message(1, (PHASE_ENTRY, 3, 5), (PHASE_COMPLETE, 3, 5))))
    e.ingest(decode(drops_message(3, (PHASE_ENTRY, 4, 8), (PHASE_COMPLETE, 4, 8))))
    e.ingest(decode(drops_message(2, (PHASE_ENTRY, 9, 9), (PHASE_COMPLETE, 9, 9))))
    assert e.check_hangs(500.0) == []  # long past the hang timeout
    for r in WORLD:
        goodbye(e, r)
    assert e.finish() == []
    assert e.stats.verified == 10 - 7  # seqs 3..9 lack somebody's records
    assert e.dropped.not_verified == 7
    assert e.dropped.by_rank == {0: 1, 1: 3, 2: 1, 3: 5}
    assert e.dropped.counters()["not_verified"] == 7


@ENGINES
def test_a_dropped_completion_is_no_hang_and_a_real_absence_still_is_missing(fast):
    """Rank 2 dropped seq 3's completion: no hang. Rank 3 never entered seq 5 and said no
    drop: still missing_rank (dropping somewhere else excuses nothing else)."""
    e = Engine(4, hang_timeout=30.0, fast=fast)
    for r in WORLD:
        recs = [entry(s, 100.0 + s) for s in range(6) if not (r == 3 and s == 5)]
        recs += [done(s, 100.0 + s) for s in range(5) if not (r == 2 and s == 3)]
        feed(e, r, recs)
    e.ingest(decode(drops_message(2, (PHASE_COMPLETE, 3, 3))))
    e.ingest(decode(drops_message(3, (PHASE_COMPLETE, 1, 1))))  # out of order, elsewhere
    found = e.finish()
    assert [(f.kind, f.seq, f.culprits) for f in found] == [(Kind.MISSING_RANK, 5, [3])]
    assert e.dropped.by_rank == {2: 1, 3: 1}


def test_the_rank_book_keeps_ranges_bounded():
    book = DropBook()
    assert not book
    for seq in (3, 4, 4, 5, 9):
        book.note(rec(seq=seq))
    book.note(rec(seq=2, phase=PHASE_ENTRY))
    assert sorted(book.take()) == [("0", WORLD, PHASE_COMPLETE, 3, 5),
                                   ("0", WORLD, PHASE_COMPLETE, 9, 9),
                                   ("0", WORLD, PHASE_ENTRY, 2, 2)]
    assert not book and book.take() == []
    for seq in range(0, 4 * MAX_RANGES, 2):  # every other seq: beyond the bound, stretched
        book.note(rec(seq=seq))
    ranges = book.take()
    assert len(ranges) == MAX_RANGES and ranges[-1][4] == 4 * MAX_RANGES - 2


def test_intervals_merge():
    iv = Intervals()
    assert iv.add(5, 7) == 3 and iv.add(1, 2) == 2 and iv.add(3, 4) == 2
    assert (iv.lo, iv.hi) == ([1], [7]) and iv.add(2, 9) == 2 and len(iv) == 9
    assert 9 in iv and 10 not in iv and 0 not in iv


def test_drop_ranges_are_validated():
    assert decode(drops_message(1, (PHASE_COMPLETE, 3, 5))).env.drops[0].last == 5
    for bad in ((PHASE_COMPLETE, 5, 3), (7, 1, 1), (PHASE_ENTRY, -1, 2)):
        with pytest.raises(WireError, match="drop range") as err:
            decode(drops_message(1, bad))
        assert err.value.reason == "bad_drops"
