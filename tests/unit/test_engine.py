"""The engine on hand-made records: majority, ties, link attribution, checksum tolerance."""

from __future__ import annotations

import pytest

from commcheck.engine import Engine
from commcheck.engine.findings import NanInfCount
from commcheck.engine.verdicts import reduction_tolerance

from ..records import WORLD, feed, feed_all, gathered, rec, scattered

pytestmark = pytest.mark.timeout(30)


def test_identical_outputs_verify_without_findings():
    engine, findings = feed_all({r: [rec(seq=0), rec(seq=1)] for r in WORLD})
    assert findings == []
    assert engine.stats.verified == 2
    assert engine.unmatched() == 0


def test_minority_rank_is_the_culprit():
    engine, findings = feed_all({r: [rec(out=(9, 9) if r == 2 else (1, 1))] for r in WORLD})
    [f] = findings
    assert (f.kind, f.culprits, f.hosts, f.ambiguous) == ("value_mismatch", [2], ["node1"], False)
    assert f.callsite == "train.py:10 main"
    assert [s.ranks for s in f.detail.sides] == [[0, 1, 3], [2]]


def test_a_tie_is_ambiguous_and_lists_every_side():
    _, findings = feed_all({r: [rec(out=(9, 9) if r >= 2 else (1, 1))] for r in WORLD})
    [f] = findings
    assert f.ambiguous
    assert f.culprits == [0, 1, 2, 3]
    assert sorted(s.ranks for s in f.detail.sides) == [[0, 1], [2, 3]]


def test_decision_waits_for_every_member_of_the_group():
    engine = Engine(4)
    for r in (0, 1, 2):
        assert feed(engine, r, [rec(out=(9, 9) if r == 2 else (1, 1))]) == []
    assert engine.unmatched() == 1
    [f] = feed(engine, 3, [rec()])
    assert f.culprits == [2]
    assert engine.unmatched() == 0


def test_subgroup_keys_do_not_mix_with_the_world_group():
    sub = (0, 1, 3)
    engine = Engine(4)
    for r in WORLD:
        recs = [rec(seq=0)]
        if r in sub:
            recs.append(rec(seq=0, ranks=sub, out=(7, 7) if r == 3 else (2, 2)))
        feed(engine, r, recs)
    assert engine.stats.verified == 2
    assert engine.stats.findings == 1


def test_mixed_hash_algorithms_are_not_compared():
    _, findings = feed_all({r: [rec(out=(r, r), algo="xxh3-128" if r else "ccmix64x2-v1")]
                            for r in WORLD})
    assert findings == []


SENT = {r: (100 + r, 0) for r in WORLD}


def test_link_corruption_names_the_link_not_only_the_rank():
    records = {}
    for r in WORLD:
        recv = dict(SENT)
        if r == 3:
            recv[1] = (666, 0)
        records[r] = [gathered(r, SENT, recv)]
    _, findings = feed_all(records)
    [f] = findings  # the receiver's differing output is explained by the link
    assert (f.kind, f.culprits, f.detail.links) == ("link_corruption", [3], [(1, 3)])


def test_clean_gather_has_no_finding():
    _, findings = feed_all({r: [gathered(r, SENT, dict(SENT))] for r in WORLD})
    assert findings == []


def test_permuted_gather_is_two_corrupted_links_on_the_receiver():
    records = {}
    for r in WORLD:
        recv = dict(SENT)
        if r == 0:
            recv[0], recv[2] = SENT[2], SENT[0]
        records[r] = [gathered(r, SENT, recv)]
    [f] = feed_all(records)[1]
    assert f.culprits == [0] and f.detail.links == [(0, 0), (2, 0)]


def _all_reduce(out_sum: float, in_sums=(1.0, 2.0, 3.0, 4.0), absmax=1.0, dtype="float32"):
    return {r: [rec(redop="SUM", dtype=dtype, in_summary=(in_sums[r], absmax, 0, 0),
                    out_summary=(out_sum, absmax * 4, 0, 0))] for r in WORLD}


def test_reduction_within_tolerance_is_clean():
    tol = reduction_tolerance("float32", 4, 100, 4.0)
    assert feed_all(_all_reduce(10.0 + 0.9 * tol))[1] == []


def test_consistent_but_wrong_reduction_is_reported():
    tol = reduction_tolerance("float32", 4, 100, 4.0)
    [f] = feed_all(_all_reduce(10.0 + 1.1 * tol))[1]
    assert f.kind == "reduction_error" and f.ambiguous and f.culprits == []
    assert f.detail.ranks["0"].expected_sum == 10.0


def test_tolerance_scales_with_dtype_precision():
    assert reduction_tolerance("bfloat16", 4, 100, 1.0) > \
        reduction_tolerance("float32", 4, 100, 1.0) > reduction_tolerance("float64", 4, 100, 1.0)
    assert feed_all(_all_reduce(10.05, dtype="bfloat16"))[1] == []
    assert len(feed_all(_all_reduce(10.05, dtype="float64"))[1]) == 1


def test_nan_input_is_an_onset_not_a_reduction_error():
    recs = _all_reduce(float("nan"))
    recs[1][0].in_summary = (float("nan"), 1.0, 1, 0)
    [f] = feed_all(recs)[1]
    assert (f.kind, f.culprits) == ("nan_inf", [1])
    assert f.detail.inputs == {"1": NanInfCount(nan=1, inf=0)}


def test_later_nan_collectives_fold_into_the_onset():
    engine = Engine(4)
    records = {r: [] for r in WORLD}
    for seq in range(4):
        for r in WORLD:
            nan_in = seq == 1 and r == 3
            nan_out = seq >= 1
            records[r].append(rec(seq=seq, redop="SUM",
                                  in_summary=(float("nan") if nan_in else 1.0, 1.0,
                                              int(nan_in), 0),
                                  out_summary=(float("nan") if nan_out else 4.0, 4.0,
                                               int(nan_out), 0)))
    findings = []
    for r in WORLD:
        findings += feed(engine, r, records[r])
    [f] = findings
    assert (f.kind, f.seq, f.culprits) == ("nan_inf", 1, [3])
    assert f.detail.later_collectives_with_nan_inf == 2
    assert engine.stats.nan_folded == 2


def test_a_second_group_has_its_own_onset():
    sub = (0, 1)
    engine = Engine(4)
    for r in (0, 1):
        feed(engine, r, [rec(ranks=sub, in_summary=(float("inf"), 1.0, 0, 1 if r else 0),
                             out_summary=(float("inf"), 1.0, 0, 1))])
    assert engine.stats.findings == 1
    [f] = feed_all({r: [rec(in_summary=(float("nan"), 1.0, int(r == 0), 0),
                            out_summary=(float("nan"), 1.0, 1, 0))] for r in WORLD})[1]
    assert f.culprits == [0]


def test_reduce_scatter_blames_the_rank_with_the_wrong_chunk():
    in_sums = [[1.0, 2.0, 3.0, 4.0]] * 4
    expected = [4.0, 8.0, 12.0, 16.0]
    records = {r: [scattered(r, in_sums[r], expected[r] + (50.0 if r == 1 else 0.0))]
               for r in WORLD}
    [f] = feed_all(records)[1]
    assert (f.kind, f.culprits) == ("reduction_error", [1])
    assert feed_all({r: [scattered(r, in_sums[r], expected[r])] for r in WORLD})[1] == []


def test_engine_is_done_when_every_rank_said_goodbye():
    from commcheck.wire import GOODBYE, BatchBuilder, decode, encode

    engine = Engine(2)
    for r in (0, 1):
        assert not engine.done
        engine.ingest(decode(encode(BatchBuilder("r", r, "h", 2).control(GOODBYE, 0))))
    assert engine.done


def test_a_world_larger_than_the_collector_was_told_is_waited_for_whole():
    """``collect --world-size 2`` for a job of 4: done only when all 4 said goodbye (it
    stopped after the first 2, before the others' last records)."""
    from commcheck.wire import GOODBYE, BatchBuilder, decode, encode

    engine = Engine(2)
    for r in range(4):
        assert not engine.done
        engine.ingest(decode(encode(BatchBuilder("r", r, "h", 4).control(GOODBYE, 0))))
    assert engine.done and engine.world_size == 4


def _entry(seq=0, ranks=WORLD, **kw):
    from commcheck.wire import PHASE_ENTRY

    return rec(seq=seq, ranks=ranks, phase=PHASE_ENTRY, flags=0, **kw)


def test_desync_names_the_minority_variant_from_entry_records_alone():
    engine, findings = feed_all({r: [_entry(numel_in=99 if r == 1 else 100,
                                            callsite=f"train.py:{7 if r == 1 else 10} f")]
                                 for r in WORLD})
    [f] = findings
    assert (f.kind, f.culprits, f.hosts, f.ambiguous) == ("desync", [1], ["node0"], False)
    assert f.detail.fields == ["numel_in"]
    assert [v.ranks for v in f.detail.variants] == [[0, 2, 3], [1]]
    assert f.detail.variants[1].callsites == ["train.py:7 f"]
    assert f.callsite == "train.py:7 f"
    assert engine.unmatched() == 1  # still waiting for completion, if it ever comes


def test_desync_on_op_tie_is_ambiguous_and_suppresses_value_verdicts():
    records = {r: [_entry(op="broadcast" if r % 2 else "all_reduce"),
                   rec(op="broadcast" if r % 2 else "all_reduce", out=(r, r))] for r in WORLD}
    _, findings = feed_all(records)
    [f] = findings
    assert f.kind == "desync" and f.ambiguous and f.culprits == [0, 1, 2, 3]
    assert f.detail.fields == ["op"]


def test_identical_entries_are_not_a_desync():
    engine, findings = feed_all({r: [_entry(), rec()] for r in WORLD})
    assert findings == [] and engine.stats.verified == 1 and engine.unmatched() == 0


def test_missing_rank_after_the_hang_timeout_names_who_never_joined():
    engine = Engine(4, hang_timeout=30)
    for r in WORLD:
        done = [_entry(seq=4, t_enter=90.0, callsite="train.py:50 f"),
                rec(seq=4, t_enter=90.0, callsite="train.py:50 f")]
        feed(engine, r, done + ([] if r == 2 else
                                [_entry(seq=5, t_enter=100.0 + r, callsite="train.py:60 f")]))
    assert engine.check_hangs(now=120.0) == []
    [f] = engine.check_hangs(now=131.5)
    assert (f.kind, f.seq, f.culprits, f.hosts) == ("missing_rank", 5, [2], ["node1"])
    assert f.detail.waiting == [0, 1, 3]
    assert f.detail.waited_s == 31.5
    assert f.detail.last["2"].at == "0[0-3] seq 4"
    assert f.detail.last["2"].ago_s == 41.5
    assert f.callsite == "train.py:60 f"
    assert engine.check_hangs(now=500.0) == []  # reported once


def test_a_rank_never_heard_from_is_missing_with_no_last_record():
    engine = Engine(4, hang_timeout=5)
    for r in (0, 1, 2):
        feed(engine, r, [_entry(t_enter=10.0)])
    [f] = engine.check_hangs(now=20.0)
    assert f.culprits == [3] and f.detail.last == {"3": None}


def test_finish_reports_open_collectives_missing_members():
    engine = Engine(4, hang_timeout=1e9)
    for r in (0, 1, 2):
        feed(engine, r, [rec(seq=0)])
    assert engine.check_hangs(now=100.0) == []
    [f] = engine.finish()
    assert f.kind == "missing_rank" and f.culprits == [3] and f.detail.waited_s is None


def test_a_p2p_message_is_one_send_and_one_recv_not_a_desync():
    pair = (1, 3)
    send = dict(op="send", ranks=pair, numel_in=40, numel_out=0, peer=3)
    recv = dict(op="recv", ranks=pair, numel_in=0, numel_out=40, peer=1)
    engine = Engine(4)
    assert feed(engine, 1, [_entry(**send)]) + feed(engine, 3, [_entry(**recv)]) == []
    engine = Engine(4)
    found = feed(engine, 1, [_entry(**send)]) + feed(engine, 3, [_entry(**{**recv,
                                                                         "numel_out": 39})])
    [f] = found
    assert f.kind == "desync" and f.ambiguous and f.detail.fields == ["numel"]


# -- the exact path's memory bound (issue 5) ------------------------------------------------

PAIR = (0, 1)


def _p2p(rank: int, seq: int) -> list:
    """One message 0 -> 1 as the capture reports it: chunks send it to the exact path."""
    from commcheck.wire import F_IN_HASH, F_OUT_HASH, SIDE_IN, SIDE_OUT, Chunk

    h = (1000 + seq, 7)
    if rank == 0:
        return [rec(op="send", seq=seq, ranks=PAIR, group_name="p2p:0->1", peer=1,
                    numel_in=40, numel_out=0, inp=h, out=(0, 0), flags=F_IN_HASH,
                    chunks=[Chunk(SIDE_IN, 1, *h)])]
    return [rec(op="recv", seq=seq, ranks=PAIR, group_name="p2p:0->1", peer=0,
                numel_in=0, numel_out=40, inp=(0, 0), out=h, flags=F_OUT_HASH,
                chunks=[Chunk(SIDE_OUT, 0, *h)])]


def _pair_all_reduce(rank: int, seq: int) -> list:
    return [_entry(seq=seq, ranks=PAIR, t_enter=float(seq)),
            rec(seq=seq, ranks=PAIR, t_enter=float(seq))]


def _feed_range(engine: Engine, rank: int, make, seqs, per_batch: int = 100,
                check=None) -> list:
    seqs, findings = list(seqs), []
    for i in range(0, len(seqs), per_batch):
        findings += feed(engine, rank, [r for s in seqs[i:i + per_batch] for r in make(rank, s)])
        if check is not None:
            check()
    return findings


def _odd_shape(rank: int, seq: int) -> list:
    """Rank 0's records have 5 dims (the exact path); rank 1's would be fast on their own."""
    shape = (1, 1, 1, 1, 100) if rank == 0 else (100,)
    return [rec(seq=seq, ranks=PAIR, in_shape=shape, out_shape=shape, t_enter=float(seq))]


@pytest.mark.parametrize("fast,make", [(False, _pair_all_reduce), (False, _p2p), (True, _p2p),
                                       (True, _odd_shape)],
                         ids=["exact-all_reduce", "exact-p2p", "fast-p2p", "fast-odd-shape"])
def test_a_silent_rank_keeps_the_exact_path_under_its_cap(fast, make):
    """Rank 1 never reports: open keys stay under the cap (cells = keys x group size), the
    oldest are evicted and counted, and rank 1's records for them, arriving late, are
    counted as late without reopening a key or making a finding."""
    cap, n = 50, 3000
    engine = Engine(4, hang_timeout=5.0, fast=fast, max_exact_cells=2 * cap)
    if fast:
        assert engine.fast is not None

    def bounded():
        assert len(engine.open) <= cap and engine.unmatched() <= cap
        assert engine.open.cells == 2 * len(engine.open)

    assert _feed_range(engine, 0, make, range(n), check=bounded) == []
    assert engine.stats.evicted == n - cap and engine.stats.late == 0
    assert sorted(k[3] for k in engine.open) == list(range(n - cap, n))
    per_seq = len(make(1, 0))
    assert _feed_range(engine, 1, make, range(500)) == []  # evicted seqs: late, dropped
    assert engine.stats.late == 500 * per_seq
    assert len(engine.open) == cap and engine.stats.evicted == n - cap
    # The keys that remain still hang, and still match: one missing_rank for the first,
    # the later ones (the same rank missing in the same group) folded into it.
    [hang] = engine.check_hangs(now=1e9)
    assert (hang.kind, hang.seq, hang.culprits) == ("missing_rank", n - cap, [1])
    assert hang.detail.later_collectives == cap - 1
    assert _feed_range(engine, 1, make, range(n - cap, n)) == []
    assert engine.stats.verified == cap and engine.unmatched() == 0 and engine.finish() == []
    assert engine.stats.findings == 1  # the hang above, nothing else


def test_the_fast_and_exact_engines_evict_the_same_p2p_keys():
    engines = [Engine(4, fast=f, max_exact_cells=2 * 64) for f in (False, True)]
    for e in engines:
        _feed_range(e, 0, _p2p, range(1000), per_batch=37)
        _feed_range(e, 1, _p2p, range(0, 1000, 3), per_batch=37)
    slow, fast = engines
    assert vars(slow.stats) == vars(fast.stats)
    assert slow.stats.late == len(range(0, 1000 - 64, 3)) and slow.stats.evicted == 1000 - 64
    assert sorted(slow.open) == sorted(fast.open)


def test_a_group_far_behind_on_the_exact_path_is_evicted_by_span():
    """max_span bounds each group's open seqs, as a fast window's ring: a key max_span or
    more seqs under its group's newest is evicted; other groups are not touched."""
    engine = Engine(4, fast=False, max_span=64)
    assert engine.max_span == 64 and engine.max_exact_cells == 2**17  # the defaults' share
    feed(engine, 0, [rec(seq=0, ranks=(0, 2))])  # another group, one old open key
    _feed_range(engine, 0, _pair_all_reduce, range(1000), per_batch=50)
    assert engine.unmatched() == 64 + 1
    assert sorted(k[3] for k in engine.open if k[2] == PAIR) == list(range(1000 - 64, 1000))
    assert engine.stats.evicted == 1000 - 64
    assert _feed_range(engine, 1, _pair_all_reduce, [5, 999]) == []
    assert engine.stats.late == 2 and engine.stats.verified == 1  # seq 5: entry + completion


def test_a_clean_run_under_the_cap_evicts_nothing():
    # At most 10 keys (5 p2p, 5 all_reduce) of 2 members are ever open at once: the cap.
    engine = Engine(4, fast=False, max_exact_cells=2 * 10, max_span=16)
    findings = []
    for start in range(0, 2000, 5):
        for r in PAIR:
            findings += _feed_range(engine, r, _p2p, range(start, start + 5))
            findings += _feed_range(engine, r, _pair_all_reduce, range(start, start + 5))
    assert findings == [] and engine.stats.verified == 4000
    assert engine.stats.evicted == engine.stats.late == engine.unmatched() == 0
    assert len(engine.open.order) == 0 and engine.open.cells == 0
    # closed keys leave a heap only lazily, but nothing piles up
    assert [len(w.seqs) for w in engine.open.windows.values()] == [5, 5]
