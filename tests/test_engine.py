"""The engine on hand-made records: majority, ties, link attribution, checksum tolerance."""

from __future__ import annotations

import pytest

from commcheck.engine import Engine
from commcheck.engine.verdicts import reduction_tolerance

from .records import WORLD, feed, feed_all, gathered, rec, scattered

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
    assert [s["ranks"] for s in f.detail["sides"]] == [[0, 1, 3], [2]]


def test_a_tie_is_ambiguous_and_lists_every_side():
    _, findings = feed_all({r: [rec(out=(9, 9) if r >= 2 else (1, 1))] for r in WORLD})
    [f] = findings
    assert f.ambiguous
    assert f.culprits == [0, 1, 2, 3]
    assert sorted(s["ranks"] for s in f.detail["sides"]) == [[0, 1], [2, 3]]


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
    assert (f.kind, f.culprits, f.detail["links"]) == ("link_corruption", [3], [[1, 3]])


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
    assert f.culprits == [0] and f.detail["links"] == [[0, 0], [2, 0]]


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
    assert f.detail["ranks"]["0"]["expected_sum"] == 10.0


def test_tolerance_scales_with_dtype_precision():
    assert reduction_tolerance("bfloat16", 4, 100, 1.0) > \
        reduction_tolerance("float32", 4, 100, 1.0) > reduction_tolerance("float64", 4, 100, 1.0)
    assert feed_all(_all_reduce(10.05, dtype="bfloat16"))[1] == []
    assert len(feed_all(_all_reduce(10.05, dtype="float64"))[1]) == 1


def test_nan_inputs_skip_the_checksum():
    recs = _all_reduce(float("nan"))
    recs[1][0].in_summary = (float("nan"), 1.0, 1, 0)
    assert feed_all(recs)[1] == []


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
