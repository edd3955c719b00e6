"""The collector's restart point: an engine restored from its snapshot decides the rest of
the traffic exactly as the engine that was never interrupted."""

from __future__ import annotations

import pickle

import pytest

from commcheck.collector import snapshot
from commcheck.collector.snapshot import SnapshotError
from commcheck.engine import Engine
from commcheck.wire import PHASE_ENTRY, BatchBuilder, decode, encode
from tests.unit.test_engine_fast import _batches, _js, _state, _traffic


@pytest.mark.parametrize("seed", range(12))
def test_restored_engine_decides_the_rest_like_the_uninterrupted_one(seed):
    rng, streams = _traffic(seed, keys=80)
    batches = _batches(rng, streams, 5, shuffle=seed % 3 == 0)
    fast = seed % 2 == 0
    ref = Engine(5, hang_timeout=5.0, fast=fast)
    cur = Engine(5, hang_timeout=5.0, fast=fast)
    cuts = 0
    i = 0
    while i < len(batches):
        k = rng.randint(1, 8)
        part = batches[i:i + k]
        assert _js(cur.ingest_many(part)) == _js(ref.ingest_many(part))
        if rng.random() < 0.3 or not cuts:  # the collector commits, is killed, restarts
            cur = snapshot.load(snapshot.dump(cur))
            cuts += 1
            assert _state(cur) == _state(ref)
        if rng.random() < 0.3:
            now = 100.0 + rng.random() * 60
            assert _js(cur.check_hangs(now)) == _js(ref.check_hangs(now))
        i += k
    assert cuts > 0
    assert _js(cur.finish()) == _js(ref.finish())
    assert _state(cur) == _state(ref)
    assert ref.stats.records > 0


def test_snapshot_is_bounded_by_the_open_window_not_the_run():
    """Tables keep their high-water capacity and chunk tables live while a cell points into
    them, but a snapshot holds only what is open: once everything closed, what is left
    (ids, rank books, free lists and rings sized by the peak) is a small fraction of the
    open window, in a short run and a run four times longer alike."""
    def run(keys: int) -> tuple[int, int, Engine]:
        rng, streams = _traffic(3, keys=keys, p_trouble=0.0)
        batches = _batches(rng, streams, 5, shuffle=False)
        e = Engine(5)
        top = 0
        for i in range(0, len(batches), 8):
            e.ingest_many(batches[i:i + 8])
            top = max(top, len(snapshot.dump(e)))
        assert e.finish() == [] and e.fast.open_rows == 0
        return top, len(snapshot.dump(e)), e

    short_peak, short_end, _ = run(200)
    long_peak, long_end, e = run(800)
    assert e.stats.verified >= 790 and e.fast.kept == {}
    assert short_end < short_peak / 5 and long_end < long_peak / 5
    assert long_end < 3 * short_end


def test_a_snapshot_cannot_run_code_or_come_from_another_version():
    class Evil:
        def __reduce__(self):
            import os
            return os.system, ("echo pwned",)

    evil = snapshot._HEADER + pickle.dumps(Evil())
    with pytest.raises(SnapshotError, match="posix.system|os.system"):
        snapshot.load(evil)
    with pytest.raises(SnapshotError, match="not a commcheck engine snapshot"):
        snapshot.load(b"hello")
    other = b"commcheck-snapshot 99 9.9\n" + pickle.dumps(Engine(2))[0:10]
    with pytest.raises(SnapshotError, match="99 9.9"):
        snapshot.load(other)
    with pytest.raises(SnapshotError, match="damaged snapshot"):
        snapshot.load(snapshot.dump(Engine(2))[:-20])
    not_engine = snapshot._HEADER + pickle.dumps({"a": 1})
    with pytest.raises(SnapshotError, match="does not hold an engine"):
        snapshot.load(not_engine)


@pytest.mark.parametrize("fast", [True, False])
def test_a_hang_open_across_a_restart_is_timed_from_its_first_entry(fast):
    """Ranks 0-2 enter seq 0 at t=100, rank 3 never does: the restored engine reports the
    hang at the same time as one never restarted (not earlier, not twice)."""
    from tests.records import rec

    def batch(rank: int):
        b = BatchBuilder("r", rank, f"node{rank // 2}", 4)
        return decode(encode(b.build([rec(seq=0, phase=PHASE_ENTRY, t_enter=100.0)], seq=1)))

    ref, cur = Engine(4, hang_timeout=5.0, fast=fast), Engine(4, hang_timeout=5.0, fast=fast)
    for e in (ref, cur):
        e.ingest_many([batch(r) for r in range(3)])
    cur = snapshot.load(snapshot.dump(cur))
    assert cur.check_hangs(104.0) == ref.check_hangs(104.0) == []
    late = cur.check_hangs(106.0)
    assert _js(late) == _js(ref.check_hangs(106.0))
    assert [f.culprits for f in late] == [[3]]
    cur = snapshot.load(snapshot.dump(cur))
    assert cur.check_hangs(200.0) == []  # reported once, before the restart


@pytest.mark.parametrize("traffic", ["fsdp", "moe"])
def test_chunked_rows_restored_mid_stream_decide_like_the_uninterrupted_engine(traffic):
    """Open rows holding chunk pointers and reduce_scatter sums (what a snapshot may save
    as one fill value when no row in use sets them) survive a restore."""
    from commcheck.collector.bench import Plan, build

    plan = Plan(ranks=64, records=12_000, batch=64, mismatch=0.05, **{traffic: True})
    msgs = [decode(m) for m in build(plan, list(range(plan.ranks)))]
    ref, cur = Engine(plan.ranks), Engine(plan.ranks)
    for i in range(0, len(msgs), 5):  # cuts inside TP groups of 8: their rows are open
        part = msgs[i:i + 5]
        assert _js(cur.ingest_many(part)) == _js(ref.ingest_many(part))
        if i % 15 == 0:
            cur = snapshot.load(snapshot.dump(cur))
    assert _js(cur.finish()) == _js(ref.finish())
    assert ref.stats.findings > 5 and cur.stats.verified == ref.stats.verified
