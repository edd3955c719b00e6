"""Ties broken by evidence (issue 18): two ranks that disagree, settled by the records."""

from __future__ import annotations

import pytest

from commcheck.engine import Engine
from commcheck.engine.verdicts import reduction_tolerance
from commcheck.wire import F_IN_HASH, F_OUT_HASH, F_OUT_SUMMARY

from ..records import feed, gathered, rec

pytestmark = pytest.mark.timeout(30)

PAIR = (0, 1)
IN_SUMS = {0: -1.8187, 1: 0.2984}  # issue 18's DDP bucket: they reduce to -1.5203


def run_pair(records: dict[int, list], fast: bool = True):
    engine = Engine(len(records), fast=fast)
    found = []
    for rank, recs in records.items():
        found += feed(engine, rank, recs)
    return engine, found


def _reduced(out_sums: dict[int, float], op="all_reduce", redop="SUM", numel=1000):
    return {r: [rec(op=op, ranks=PAIR, redop=redop, numel_in=numel, numel_out=numel,
                    in_summary=(IN_SUMS[r], 2.0, 0, 0), out_summary=(out_sums[r], 2.0, 0, 0),
                    out=(7, 7) if out_sums[r] != out_sums[0] else (1, 1))]
            for r in PAIR}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("op", ["all_reduce", "ddp_allreduce"])
def test_high_bit_flip_on_two_ranks_names_one_culprit_with_its_evidence(op, fast):
    """Bit 30 of a float32 flipped on rank 1: its output sums to -1.43e37."""
    _, findings = run_pair(_reduced({0: -1.5203, 1: -1.43e37}, op=op), fast)
    [f] = findings
    assert (f.kind, f.culprits, f.ambiguous) == ("value_mismatch", [1], False)
    assert f.detail.tie.by == "reduction" and f.detail.tie.decided
    assert "output sum -1.43e+37, inputs reduce to -1.52" in f.detail.tie.evidence
    assert [s.ranks for s in f.detail.sides] == [[0], [1]]  # the right side first
    assert f.detail.sum_abs_diff == pytest.approx(1.43e37)


def test_the_lower_rank_can_be_the_culprit():
    _, findings = run_pair(_reduced({0: float("inf"), 1: -1.5203}))
    [f] = findings
    assert (f.culprits, f.ambiguous) == ([0], False)


def test_low_bit_flip_stays_ambiguous_and_says_why():
    """The last mantissa bit of one element: inside the reduction's tolerance."""
    _, findings = run_pair(_reduced({0: -1.5203, 1: -1.5203 + 2e-7}))
    [f] = findings
    assert (f.culprits, f.ambiguous) == ([0, 1], True)
    assert not f.detail.tie.decided
    assert "cannot be told from rounding" in f.detail.tie.evidence
    assert set(f.detail.tie.ranks) == {"0", "1"}


def test_the_tolerance_edge_decides_a_tie_only_beyond_it():
    tol = reduction_tolerance("float32", 2, 1000, 4.0)
    expected = IN_SUMS[0] + IN_SUMS[1]
    inside = run_pair(_reduced({0: expected, 1: expected + 0.99 * tol}))[1]
    beyond = run_pair(_reduced({0: expected, 1: expected + 1.01 * tol}))[1]
    assert inside[0].ambiguous and not beyond[0].ambiguous
    assert beyond[0].culprits == [1]


def test_when_neither_side_reduces_right_the_tie_stays():
    [f] = run_pair(_reduced({0: 50.0, 1: -50.0}))[1]
    assert f.ambiguous and "no side's output sum is within tolerance" in f.detail.tie.evidence


def test_an_unchecked_reduce_op_stays_ambiguous_with_its_reason():
    [f] = run_pair(_reduced({0: -1.5203, 1: -1.43e37}, redop="MAX"))[1]
    assert f.ambiguous and "reduce op MAX is not checked" in f.detail.tie.evidence


def test_without_output_sums_the_tie_stays():
    recs = _reduced({0: -1.5203, 1: -1.43e37})
    for r in PAIR:
        recs[r][0].flags &= ~F_OUT_SUMMARY
    [f] = run_pair(recs)[1]
    assert f.ambiguous and "recorded no output sum" in f.detail.tie.evidence


def test_three_ranks_are_decided_by_majority_as_before():
    trio = (0, 1, 2)
    recs = {r: [rec(ranks=trio, redop="SUM", out=(7, 7) if r == 1 else (1, 1),
                    in_summary=(1.0, 1.0, 0, 0), out_summary=(1e37 if r == 1 else 3.0, 1, 0, 0))]
            for r in trio}
    [f] = run_pair(recs)[1]
    assert (f.kind, f.culprits, f.ambiguous, f.detail.tie) == ("value_mismatch", [1], False,
                                                              None)


def _broadcast(outs: dict[int, tuple[int, int]]):
    return {r: [rec(op="broadcast", ranks=PAIR, root=0, inp=(5, 5), out=outs[r],
                    flags=F_OUT_HASH | (F_IN_HASH if r == 0 else 0))] for r in PAIR}


@pytest.mark.parametrize("outs, culprit", [({0: (5, 5), 1: (9, 9)}, 1),
                                           ({0: (9, 9), 1: (5, 5)}, 0)])
def test_a_broadcast_tie_goes_to_the_roots_input(outs, culprit):
    [f] = run_pair(_broadcast(outs))[1]
    assert (f.kind, f.culprits, f.ambiguous) == ("value_mismatch", [culprit], False)
    assert f.detail.tie.by == "root_input"
    assert "root rank 0's input" in f.detail.tie.evidence


def test_a_broadcast_whose_outputs_both_differ_from_the_root_stays_a_tie():
    [f] = run_pair(_broadcast({0: (8, 8), 1: (9, 9)}))[1]
    assert f.ambiguous and "no output hashes like root rank 0's input" in f.detail.tie.evidence


SENT = {0: (100, 0), 1: (101, 0)}


def test_link_corruption_alone_on_two_ranks():
    """Rank 1 received a corrupted chunk from 0: one link_corruption, no value_mismatch
    blaming the healthy sender."""
    recs = {r: [gathered(r, SENT, dict(SENT) if r == 0 else {0: (666, 0), 1: SENT[1]})]
            for r in PAIR}
    for r in PAIR:
        recs[r][0].group_ranks = PAIR
    [f] = run_pair(recs)[1]
    assert (f.kind, f.culprits, f.detail.links) == ("link_corruption", [1], [(0, 1)])


def test_link_corruption_on_half_the_ranks_is_no_tie():
    world = (0, 1, 2, 3)
    sent = {r: (100 + r, 0) for r in world}
    recs = {}
    for r in world:
        got = dict(sent)
        if r >= 2:
            got[0] = (666, r)
        recs[r] = [gathered(r, sent, got)]
    findings = run_pair(recs)[1]
    assert sorted((f.kind, tuple(f.culprits)) for f in findings) == [
        ("link_corruption", (2,)), ("link_corruption", (3,))]


@pytest.mark.parametrize("fast", [True, False])
def test_reduce_scatter_with_uneven_inputs_is_clean(fast):
    """Each rank's output is its own slot of the input list: rank 0 gets 3 elements, rank 1
    gets 5. Legal in torch: not a desync."""
    def one(rank: int) -> list:
        return [rec(op="reduce_scatter", ranks=PAIR, redop="SUM", numel_in=8,
                    numel_out=3 if rank == 0 else 5, out=(rank, rank),
                    in_summary=(0.0, 0.0, 0, 0), out_summary=(0.0, 0.0, 0, 0))]
    engine, findings = run_pair({r: one(r) for r in PAIR}, fast)
    assert findings == []
    assert engine.stats.verified == 1


def _entry(seq: int, ranks=PAIR, **kw):
    from commcheck.wire import PHASE_ENTRY

    return rec(seq=seq, ranks=ranks, phase=PHASE_ENTRY, flags=0, **kw)


def _batch(engine: Engine, run: str, rank: int, records: list, counters: dict):
    from commcheck.wire import BatchBuilder, decode, encode

    b = BatchBuilder(run, rank, f"node{rank}", 2)
    return engine.ingest(decode(encode(b.build(records, seq=1, counters=counters))))


@pytest.mark.parametrize("fast", [True, False])
def test_two_runs_keep_their_own_rank_state(fast):
    """Runs "a" and "b" analysed together: rank 1 of run a stopped after seq 4; rank 1 of
    run b went on elsewhere. Run a's missing_rank names rank 1's last call in run a, and
    each (run, rank) keeps its own counters."""
    engine = Engine(2, hang_timeout=30, fast=fast)
    for r in PAIR:
        done = [_entry(4, t_enter=90.0, callsite="a.py:4 f"), rec(seq=4, ranks=PAIR,
                                                                  t_enter=90.0)]
        more = [] if r == 1 else [_entry(5, t_enter=100.0, callsite="a.py:5 f")]
        _batch(engine, "a", r, done + more, {"dropped": 3 + r})
    for r in PAIR:
        _batch(engine, "b", r, [_entry(0, op="broadcast", root=0, t_enter=110.0,
                                       callsite="b.py:1 g"),
                                rec(op="broadcast", seq=0, ranks=PAIR, root=0, t_enter=110.0)],
               {"not_checked": 7})
    [f] = engine.check_hangs(now=140.0)
    assert (f.kind, f.run, f.culprits) == ("missing_rank", "a", [1])
    last = f.detail.last["1"]
    assert (last.op, last.at, last.callsite) == ("all_reduce", "0[0,1] seq 4", "a.py:4 f")
    assert engine.states[("a", 1)].counters == {"dropped": 4}
    assert engine.states[("b", 1)].counters == {"not_checked": 7}
    assert engine.states[("a", 0)].records == 3 and engine.states[("b", 0)].records == 2
    assert engine.ranks[1] is engine.states[("b", 1)]  # the run it last reported under


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("src, dst", [(0, 1), (1, 0)])
def test_a_corrupted_receive_is_reported_as_the_recv(src, dst, fast):
    """isend/irecv (or batch_isend_irecv) whose receiver got other bytes than were sent:
    the finding names the receiving side's op, whichever rank is lower."""
    from commcheck.wire import SIDE_IN, SIDE_OUT, Chunk

    sent, got = (1000, 7), (1001, 7)
    recs = {src: [rec(op="send", ranks=PAIR, group_name=f"p2p:{src}->{dst}", peer=dst,
                      numel_in=40, numel_out=0, inp=sent, out=(0, 0), flags=F_IN_HASH,
                      chunks=[Chunk(SIDE_IN, dst, *sent)])],
            dst: [rec(op="recv", ranks=PAIR, group_name=f"p2p:{src}->{dst}", peer=src,
                      numel_in=0, numel_out=40, inp=(0, 0), out=got, flags=F_OUT_HASH,
                      chunks=[Chunk(SIDE_OUT, src, *got)])]}
    [f] = run_pair(recs, fast)[1]
    assert (f.kind, f.op, f.culprits, f.detail.links) == ("link_corruption", "recv", [dst],
                                                          [(src, dst)])


def _blaming(culprits: list[int]):
    from commcheck.engine import Finding, Kind
    from commcheck.engine.findings import Side, ValueMismatch

    return Finding(kind=Kind.VALUE_MISMATCH, run="r", op="all_reduce", group="0[0-3]", seq=1,
                   step=0, culprits=culprits, hosts=[], callsite="x.py:1 f",
                   detail=ValueMismatch(sides=[Side(ranks=culprits, hash="0" * 32)]))


def test_ranks_named_alike_in_every_finding_are_all_suspects():
    from commcheck.engine.suspects import describe, suspects

    hosts = {0: "node0", 1: "node0", 2: "node1"}  # rank 3 never reported
    found = suspects([_blaming([2, 3]), _blaming([2, 3])], hosts)
    host, rank = found
    assert describe(host) == "suspect host node1: 2 of 2 findings on ranks 2"
    assert describe(rank) == "suspect ranks 2,3: culprits in every finding"
    assert [(a.rank, a.host) for a in rank.alike] == [(3, "")]
    hosts[3] = "node1"
    assert describe(suspects([_blaming([2, 3]), _blaming([2, 3])], hosts)[1]) == \
        "suspect ranks 2,3 (node1): culprits in every finding"


def test_a_host_suspect_counts_findings_not_culprits():
    from commcheck.engine.suspects import suspects

    hosts = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    [host] = [s for s in suspects([_blaming([2, 3]), _blaming([1])] + [_blaming([2])] * 2,
                                  hosts) if s.kind == "host"]
    assert (host.host, host.findings, host.of, host.ranks) == ("node1", 3, 4, [2, 3])


def test_missing_rank_says_waiting_only_of_ranks_known_alive_and_blocked():
    """Ranks 0-2 entered, rank 3 never did. Rank 0 is alive (its relay says so), rank 1
    died after entering, rank 2 has no relay and sent nothing since: not "waiting"."""
    from commcheck.engine.state import Liveness

    world = (0, 1, 2, 3)
    engine = Engine(4, hang_timeout=30)
    for r in (0, 1, 2):
        feed(engine, r, [_entry(0, ranks=world, t_enter=100.0)])
    engine.observe(0, Liveness(state="alive", idle_s=1.0, seen_t=130.0), 130.0)
    engine.observe(1, Liveness(state="gone", exit_code=1, seen_t=130.0), 130.0)
    found = engine.check_hangs(now=131.0)
    [missing] = [f for f in found if f.kind == "missing_rank"]
    assert missing.culprits == [3] and missing.detail.waiting == [0, 1, 2]
    assert missing.detail.not_waiting == {"1": "died", "2": "silent"}
    from commcheck.collector.report import _how_far

    assert _how_far(missing).startswith("rank 0 waiting for 31.0 s; rank 1 entered it, then "
                                        "died; rank 2 entered it, no longer reporting; ")


def test_both_engines_count_recorded_and_verified_per_op():
    """The per-op table's counts: completion records per op, collectives verified per op
    (a p2p message counts for its send and its recv); entry records are not counted."""
    world = (0, 1, 2, 3)
    counts = []
    for fast in (True, False):
        engine = Engine(4, fast=fast)
        for r in world:
            feed(engine, r, [_entry(0, ranks=world), rec(seq=0, ranks=world),
                             rec(op="ddp_allreduce", seq=1, ranks=world)])
        counts.append((engine.stats.recorded_by_op, engine.stats.verified_by_op))
    assert counts[0] == counts[1] == ({"all_reduce": 4, "ddp_allreduce": 4},
                                      {"all_reduce": 1, "ddp_allreduce": 1})
