"""The vectorised path against the exact one: same findings, stats, hangs and last entries.

Random traffic (seeded) mixes clean collectives with every kind of trouble the exact path
knows — value mismatches, ties, desync, NaN onsets, wrong reductions, chunked ops, missing
members, duplicates, odd shapes — sent as entry + completion records, cut into batches of
random sizes, delivered out of order and fed one batch at a time or in blocks.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from commcheck.engine import Engine
from commcheck.engine.cells import SHAPE_DIMS
from commcheck.engine.fastpath import _EPS, _tolerance
from commcheck.engine.model import group_label
from commcheck.engine.verdicts import reduction_tolerance
from commcheck.wire import (
    F_IN_HASH,
    F_IN_SUMMARY,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    GOODBYE,
    PHASE_ENTRY,
    SIDE_IN,
    SIDE_OUT,
    BatchBuilder,
    Chunk,
    Record,
    combine_hashes,
    decode,
    encode,
)

pytestmark = pytest.mark.timeout(120)

FULL = F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY
TROUBLE = ("value", "tie", "desync", "nan", "reduction", "gather", "missing", "dup",
           "entry_differs", "algo", "shape", "avg", "reduce", "grad", "unknown", "late_entry",
           "tiny_reduction", "ag_link", "ag_sender", "ag_unhashed", "ag_order", "rs_clean",
           "rs_bad", "rs_chunk", "rs_avg", "rs_max", "rs_order", "rs_tiny", "a2a_link",
           "a2a_sender", "a2a_unhashed", "a2a_order", "a2a_uneven", "a2a_uneven_link",
           "a2a_split_differs", "a2a_dtype")
# all_gather with one output chunk per member (what ranks send): clean, or one receiver's
# chunk from one sender corrupted, or one sender's data corrupted for everyone, or one
# member that did not hash its input, or chunks out of group order.
ALL_GATHER = (None, "ag_clean", "ag_link", "ag_sender", "ag_unhashed", "ag_order")
# reduce_scatter with one input chunk (and its sum) per member: clean, one member's output
# sum off, one chunk sum off, AVG, an unchecked reduce op, chunks out of order, an error
# near the tolerance.
REDUCE_SCATTER = ("rs_clean", "rs_bad", "rs_chunk", "rs_avg", "rs_max", "rs_order",
                  "rs_tiny")
# all_to_all with one input and one output chunk per member: clean, one received chunk
# corrupted, one sent chunk not what its sender hashed, a member that did not hash its
# input, chunks out of group order.
ALL_TO_ALL = ("a2a_clean", "a2a_link", "a2a_sender", "a2a_unhashed", "a2a_order",
              "a2a_uneven", "a2a_uneven_link", "a2a_split_differs", "a2a_dtype")
# ... and with uneven split sizes (counts differ per rank, as members may): clean, one
# received chunk corrupted, a member whose completion names other splits than its entry,
# a member calling with another dtype.
UNEVEN = ("a2a_uneven", "a2a_uneven_link", "a2a_split_differs", "a2a_dtype")
# Troubles that are not findings: nothing is reported for them but missing_rank or hang (a
# hang check that ran before every member's records arrived).
QUIET = (None, "ag_order", "ag_unhashed", "a2a_clean", "a2a_uneven", "a2a_split_differs",
         "rs_clean", "rs_avg", "rs_max", "rs_order", "algo", "avg", "reduce", "unknown",
         "entry_differs")


class Expect:
    """What the injected trouble must be found as, whichever path decides it: the same
    findings on both paths prove nothing if both miss it.

    ``must``: (kind, group, seq, culprits, ambiguous) that must each be found; ``quiet``:
    (group, seq) of collectives with no trouble that is a finding; ``onsets``: kind → group
    → the (seq, culprits, ambiguous) one of which is that group's first and only finding of
    the kind (NaN onsets and divergences are reported once per group, at whichever such
    collective is decided first). Troubles whose outcome depends on random choices
    (a missing member, a duplicate, an error near the tolerance) are not checked here."""

    def __init__(self) -> None:
        self.must: list[tuple] = []
        self.quiet: set[tuple[str, int]] = set()
        self.onsets: dict[str, dict[str, set[tuple]]] = {}

    def add(self, trouble: str | None, name: str, ranks: tuple[int, ...], seq: int,
            odd: int, diverged: bool) -> None:
        group, n = group_label(name, ranks), len(ranks)

        def vote(minority: list[int]) -> tuple[list[int], bool]:
            """Majority vote: the minority, or every member on a tie."""
            return (sorted(ranks), True) if 2 * len(minority) == n else (sorted(minority), False)

        def must(kind: str, culprits: list[int], ambiguous: bool = False) -> None:
            self.must.append((kind, group, seq, culprits, ambiguous))

        if trouble in QUIET:
            self.quiet.add((group, seq))
        elif trouble == "value":
            must("value_mismatch", *vote([odd]))
        elif trouble == "tie":
            must("value_mismatch", *vote(list(ranks[: n // 2])))
        elif trouble in ("desync", "a2a_dtype"):
            must("desync", *vote([odd]))
        elif trouble == "reduction":  # wrong on every rank: no one to blame
            must("reduction_error", [], True)
        elif trouble in ("gather", "ag_link", "a2a_link", "a2a_uneven_link"):
            must("link_corruption", [odd])  # the receiver of the corrupted chunk(s)
        elif trouble == "ag_sender":  # odd's data differs from its hash for every receiver
            for r in ranks:
                must("link_corruption", [r])
        elif trouble == "a2a_sender" and odd != ranks[0]:
            must("link_corruption", [ranks[0]])
        elif trouble == "rs_bad":
            must("reduction_error", [odd])
        elif trouble == "rs_chunk":  # odd's chunk for the next member is off: its sum is
            must("reduction_error", [ranks[(ranks.index(odd) + 1) % n]])
        elif trouble == "nan":
            self.onsets.setdefault("nan_inf", {}).setdefault(group, set()).add(
                (seq, (odd,), False))
        elif trouble == "grad" and diverged:
            culprits, tie = vote([odd])
            self.onsets.setdefault("grad_divergence", {}).setdefault(group, set()).add(
                (seq, tuple(culprits), tie))

    def check(self, findings: list) -> None:
        got = [(f.kind, f.group, f.seq, f.culprits, f.ambiguous) for f in findings]
        for want in self.must:
            assert want in got, f"not found: {want}"
        for f in findings:
            assert (f.group, f.seq) not in self.quiet or f.kind in ("missing_rank", "hang"), f
        for kind, groups in self.onsets.items():
            for group, cands in groups.items():
                hits = [(f.seq, tuple(f.culprits), f.ambiguous) for f in findings
                        if f.kind == kind and f.group == group]
                assert len(hits) == 1 and hits[0] in cands, (kind, group, hits, cands)


def _collective(rng: random.Random, ranks: tuple[int, ...], name: str, seq: int,
                trouble: str | None, t0: float,
                oracle: Expect | None = None) -> dict[int, list[Record]]:
    """Entry and completion records of one collective, per member; what they must be found
    as goes to ``oracle``."""
    op, redop = "all_reduce", "SUM"
    if trouble == "avg":
        redop = "AVG"
    elif trouble == "reduce":
        op = "reduce"
    elif trouble == "grad":
        op, redop = "grad", ""
    elif trouble == "unknown":
        op = "mystery_op"
    elif trouble is None and rng.random() < 0.3:
        op, redop = rng.choice([("broadcast", ""), ("barrier", ""), ("all_reduce", "MAX"),
                                ("all_gather_into_tensor", ""), ("all_gather", ""),
                                ("all_to_all_single", "")])
        if op == "all_to_all_single":
            trouble = "a2a_clean"
    elif trouble in ALL_GATHER:
        op, redop = "all_gather_into_tensor", ""
        trouble = None if trouble == "ag_clean" else trouble
    elif trouble in ALL_TO_ALL:
        op, redop = "all_to_all_single", ""
    elif trouble in REDUCE_SCATTER:
        op = "reduce_scatter_tensor"
        redop = {"rs_avg": "AVG", "rs_max": "MAX"}.get(trouble, "SUM")
    n = len(ranks)
    numel = rng.choice([1, 7, 100, 4096])
    ins = [rng.uniform(-1, 1) * numel for _ in ranks]
    absmax = [rng.uniform(0.5, 1.0) for _ in ranks]
    total = sum(ins) / (n if redop == "AVG" else 1)
    out_hash = (rng.getrandbits(64), rng.getrandbits(64))
    odd = rng.choice(ranks)
    rs_sums = {p: [(p + 1) * (k + 1) * 0.25 + rng.uniform(-1, 1) for k in range(n)]
               for p in ranks}  # reduce_scatter: what p sends to the k-th member
    out: dict[int, list[Record]] = {}
    diverged = False
    for r in ranks:
        h = out_hash
        if trouble == "value" and r == odd:
            h = (h[0] ^ 1, h[1])
        if trouble == "tie" and r in ranks[: n // 2]:
            h = (h[0] ^ 2, h[1])
        if trouble == "grad" and r == odd and rng.random() < 0.7:
            h = (h[0] ^ 4, h[1])
            diverged = True
        out_sum = total
        if trouble == "reduction":
            out_sum = total + 1e3
        if trouble == "tiny_reduction":  # near the tolerance: exercises the margin
            tol = reduction_tolerance("float32", n, numel, sum(absmax))
            out_sum = total + tol * rng.choice([0.999999, 1.000001, 0.5, 2.0])
        in_sum, nan = ins[ranks.index(r)], 0
        if trouble == "nan" and r == odd:
            in_sum, nan = float("nan"), 3
        flags = FULL
        if op == "broadcast" and r != ranks[0]:
            flags &= ~(F_IN_HASH | F_IN_SUMMARY)
        kw = dict(group_name=name, group_ranks=ranks, seq=seq, op=op, dtype="float32",
                  redop=redop, algo="xxh3-128", callsite=f"train.py:{10 + seq % 3} f",
                  numel_in=numel, numel_out=numel, in_shape=(numel,), out_shape=(numel,),
                  step=seq // 4, t_enter=t0 + rng.random(), t_done=t0 + 1 + rng.random(),
                  in_hash=(r, 5), out_hash=h, flags=flags,
                  in_summary=(in_sum, absmax[ranks.index(r)], nan, 0),
                  out_summary=(float("nan") if trouble == "nan" else out_sum, 4.0,
                               int(trouble == "nan"), 0))
        if op == "reduce":
            kw["root"] = ranks[0]
        if trouble == "desync" and r == odd:
            kw["numel_in"] = numel + 1
        if trouble == "algo" and r == odd:
            kw["algo"] = "ccmix64x2-v1"
        if trouble == "shape":
            kw["in_shape"] = kw["out_shape"] = (1,) * (SHAPE_DIMS + 1)
        if op.startswith("all_gather") and trouble in ALL_GATHER:
            sent = {s: (s, 5) for s in ranks}
            if trouble == "ag_sender":
                sent[odd] = (odd, 6)
            chunks = [Chunk(SIDE_OUT, s, *sent[s]) for s in ranks]
            if trouble == "ag_link" and r == odd:
                chunks[0] = Chunk(SIDE_OUT, ranks[0], ranks[0], 7)
            if trouble == "ag_order" and r == odd and n > 1:
                chunks = chunks[::-1]
            fl = F_IN_HASH | F_OUT_HASH
            if trouble == "ag_unhashed" and r == odd:
                fl = F_OUT_HASH
            kw.update(redop="", flags=fl, numel_out=numel * n, out_shape=(numel * n,),
                      chunks=chunks,
                      out_hash=combine_hashes([(c.h0, c.h1) for c in sorted(
                          chunks, key=lambda c: c.index)]))
        if trouble in ALL_TO_ALL:
            def sent(src: int, dst: int) -> tuple[int, int]:
                return (src * 100 + dst, 3)

            a_in = [Chunk(SIDE_IN, d, *sent(r, d)) for d in ranks]
            a_out = [Chunk(SIDE_OUT, src, *sent(src, r)) for src in ranks]
            if trouble in ("a2a_link", "a2a_uneven_link") and r == odd:
                a_out[0] = Chunk(SIDE_OUT, ranks[0], 7, 7)
            if trouble == "a2a_sender" and odd != ranks[0] and r == ranks[0]:
                a_out[ranks.index(odd)] = Chunk(SIDE_OUT, odd, 8, 8)  # odd -> ranks[0]
            if trouble == "a2a_order" and r == odd and n > 1:
                a_out = a_out[::-1]
            fl = F_IN_HASH | F_OUT_HASH
            if trouble == "a2a_unhashed" and r == odd:
                fl = F_OUT_HASH
            if trouble in UNEVEN:
                def size(src: int, dst: int) -> int:
                    return (src * 7 + dst * 3 + seq) % 5 + 1

                split_in = tuple(size(r, d) for d in ranks)
                split_out = tuple(size(src, r) for src in ranks)
                kw.update(in_splits=split_in, out_splits=split_out,
                          numel_in=sum(split_in), numel_out=sum(split_out),
                          in_shape=(sum(split_in),), out_shape=(sum(split_out),))
                if trouble == "a2a_dtype" and r == odd:
                    kw["dtype"] = "bfloat16"
            kw.update(redop="", flags=fl, chunks=a_in + a_out,
                      in_hash=combine_hashes([(c.h0, c.h1) for c in a_in]),
                      out_hash=combine_hashes([(c.h0, c.h1) for c in sorted(
                          a_out, key=lambda c: c.index)]))
        if trouble in REDUCE_SCATTER:
            sums = rs_sums
            k = ranks.index(r)
            mine = list(sums[r])
            if trouble == "rs_chunk" and r == odd:
                mine[(k + 1) % n] += 1e3
            expect = sum(sums[p][k] for p in ranks) / (n if redop == "AVG" else 1)
            if trouble == "rs_bad" and r == odd:
                expect += 1e3
            if trouble == "rs_tiny":
                tol = reduction_tolerance("float32", n, numel, sum(absmax))
                expect += tol * rng.choice([0.999999, 1.000001, 0.5, 2.0])
            chunks = [Chunk(SIDE_IN, o, 0, 0, mine[i]) for i, o in enumerate(ranks)]
            if trouble == "rs_order" and r == odd and n > 1:
                chunks = chunks[::-1]
            kw.update(redop=redop, numel_in=numel * n, in_shape=(numel * n,),
                      flags=F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY, chunks=chunks,
                      in_summary=(sum(mine), absmax[k], 0, 0), out_summary=(expect, 4.0, 0, 0))
        if trouble == "gather":  # as ranks send it: the whole input, one output chunk each
            kw.update(op="all_gather", redop="", flags=F_IN_HASH | F_OUT_HASH, in_hash=(r, 9),
                      chunks=[Chunk(SIDE_OUT, s, s + (r == odd and s != r), 9)
                              for s in ranks])
        done = Record(**kw)
        entry = Record(**{**kw, "chunks": [], "flags": 0, "phase": PHASE_ENTRY})
        if trouble == "a2a_split_differs" and r == odd:
            entry.in_splits = entry.in_splits[::-1]
        if trouble == "entry_differs" and r == odd:
            entry.callsite = "elsewhere.py:1 g"
        recs = [done] if rng.random() < 0.2 else [entry, done]
        if trouble == "late_entry" and r == odd:
            recs = [done, entry]
        if trouble == "dup" and r == odd:
            recs = recs + [done]
        if trouble == "missing" and r == odd:
            recs = recs[:1] if rng.random() < 0.5 else []
        out[r] = recs
    if oracle is not None:
        oracle.add(trouble, name, ranks, seq, odd, diverged)
    return out


def _traffic(seed: int, world: int = 5, keys: int = 60, p_trouble: float = 0.25,
             expect: Expect | None = None):
    """Per rank, the records of several groups, in each rank's own order."""
    rng = random.Random(seed)
    groups = [("0", tuple(range(world))), ("tp0", (0, 1)), ("tp1", (2, 3, 4)),
              ("pp", (1, 3))]
    streams: dict[int, list[Record]] = {r: [] for r in range(world)}
    seqs = {g: 0 for g, _ in groups}
    t = 100.0
    for _ in range(keys):
        name, ranks = rng.choice(groups)
        trouble = rng.choice(TROUBLE) if rng.random() < p_trouble else None
        for r, recs in _collective(rng, ranks, name, seqs[name], trouble, t,
                                   expect).items():
            streams[r].extend(recs)
        seqs[name] += 1
        t += rng.random()
    return rng, streams


def _batches(rng: random.Random, streams: dict[int, list[Record]], world: int,
             shuffle: bool, nan_t: bool = False) -> list:
    out = []
    for r, recs in streams.items():
        b = BatchBuilder("run", r, f"node{r // 2}", world)
        i, bseq = 0, 0
        while i < len(recs):
            k = rng.randint(1, 40)
            part = recs[i:i + k]
            if nan_t and rng.random() < 0.1:
                part[0].t_enter = float("nan")
            out.append((r, bseq, encode(b.build(part, seq=bseq, t=float(bseq)))))
            i, bseq = i + k, bseq + 1
    if shuffle:
        rng.shuffle(out)
    else:  # each rank's batches in order, ranks interleaved at random
        by_rank: dict[int, list] = {}
        for item in out:
            by_rank.setdefault(item[0], []).append(item)
        merged = []
        while by_rank:
            r = rng.choice(sorted(by_rank))
            merged.append(by_rank[r].pop(0))
            if not by_rank[r]:
                del by_rank[r]
        out = merged
    return [decode(p) for _, _, p in out]


def _js(findings) -> str:
    return json.dumps([f.to_json() for f in findings])


def _state(e: Engine) -> dict:
    st = dict(vars(e.stats))
    last = {r: (s.last[0], tuple(s.last[1])) if s.last else None for r, s in e.ranks.items()}
    done = {r: (s.last_done.key, tuple(s.last_done.meta), s.last_done.t_done)
            if s.last_done else None for r, s in e.ranks.items()}
    onsets = {k: (o.folded, json.dumps(o.finding.to_json())) for k, o in e.onsets.items()}
    return {"stats": st, "unmatched": e.unmatched(), "last": repr(last), "done": repr(done),
            "onsets": onsets}


def _compare(batches: list, rng: random.Random, world: int, blocks: bool,
             fast: Engine | None = None) -> tuple[Engine, Engine, list]:
    """Feed both engines alike, comparing as they go; returns them and the findings."""
    slow = Engine(world, hang_timeout=5.0, fast=False)
    fast = fast or Engine(world, hang_timeout=5.0)
    found = []
    i = 0
    while i < len(batches):
        k = rng.randint(1, 8) if blocks else 1
        part = batches[i:i + k]
        expect = []
        for b in part:
            expect += slow.ingest(b)
        got = fast.ingest_many(part) if blocks else fast.ingest(part[0])
        assert _js(got) == _js(expect), f"batches {i}..{i + k}"
        assert _state(fast) == _state(slow)
        found += got
        if rng.random() < 0.1:
            now = 100.0 + rng.random() * 60
            hangs = fast.check_hangs(now)
            assert _js(hangs) == _js(slow.check_hangs(now))
            found += hangs
        i += k
    last = fast.finish()
    assert _js(last) == _js(slow.finish())
    assert _state(fast) == _state(slow)
    return slow, fast, found + last


@pytest.mark.parametrize("seed", range(40))
def test_fast_path_matches_exact_path(seed):
    expect = Expect()
    rng, streams = _traffic(seed, expect=expect)
    batches = _batches(rng, streams, 5, shuffle=seed % 3 == 0)
    slow, _, found = _compare(batches, rng, 5, blocks=seed % 2 == 1)
    assert slow.stats.records > 0
    expect.check(found)
    assert expect.must or expect.onsets  # every seed injects trouble that is a finding


@pytest.mark.parametrize("seed", range(6))
def test_clean_traffic_stays_on_the_fast_path(seed):
    expect = Expect()
    rng, streams = _traffic(seed, p_trouble=0.0, keys=80, expect=expect)
    batches = _batches(rng, streams, 5, shuffle=False)
    slow, fast, found = _compare(batches, rng, 5, blocks=True)
    assert len(expect.quiet) == 80 and not expect.must
    expect.check(found)  # nothing but hangs seen before every record arrived
    assert fast.stats.verified == slow.stats.verified == 80
    assert fast.open == {}  # nothing ever needed the exact path


@pytest.mark.parametrize("seed", range(4))
def test_blocks_with_a_non_finite_entry_time_are_exact(seed):
    """A block holding a NaN t_enter takes the exact path, every record of it (a rank's
    "last entry" is its largest t_enter, which the vectorised update cannot order NaN
    into); blocks without one do not. Same findings either way, and the injected ones."""
    expect = Expect()
    rng, streams = _traffic(100 + seed, expect=expect)
    batches = _batches(rng, streams, 5, shuffle=False, nan_t=True)
    fast = Engine(5, hang_timeout=5.0)
    exact = [0]  # records the exact path took
    blocks: list[tuple[bool, int, int]] = []  # per block: non-finite t_enter, records, exact
    real_record, real_ingest = fast.exact.record, fast.fast.ingest

    def record(*args, **kwargs):
        exact[0] += 1
        return real_record(*args, **kwargs)

    def ingest(items, *args):
        before = exact[0]
        out = real_ingest(items, *args)
        nonfinite = any(not np.isfinite(b.records["t_enter"]).all() for b, _ in items)
        blocks.append((nonfinite, sum(len(b.records) for b, _ in items), exact[0] - before))
        return out

    fast.exact.record, fast.fast.ingest = record, ingest
    _, _, found = _compare(batches, rng, 5, blocks=True, fast=fast)
    expect.check(found)
    with_nan = [(n, e) for nonfinite, n, e in blocks if nonfinite]
    assert with_nan and all(e == n for n, e in with_nan)
    assert any(e < n for nonfinite, n, e in blocks if not nonfinite)


def test_many_small_groups_in_one_block():
    """Probe-like traffic: hundreds of groups of two, each with a few keys."""
    rng = random.Random(7)
    expect = Expect()
    streams: dict[int, list[Record]] = {0: [], 1: []}
    for step in range(3):
        for p in range(300):
            trouble = "grad" if p % 97 == 5 else None
            for r, recs in _collective(rng, (0, 1), f"grad:p{p}", step, trouble,
                                       10.0 * step, expect).items():
                streams[r].extend(recs)
    _, _, found = _compare(_batches(rng, streams, 2, shuffle=False), rng, 2, blocks=True)
    assert len(expect.onsets["grad_divergence"]) == 4  # p5, p102, p199, p296 diverged
    expect.check(found)


def test_partial_windows_report_the_same_hangs():
    rng = random.Random(3)
    streams: dict[int, list[Record]] = {r: [] for r in range(4)}
    for seq in range(30):
        for r, recs in _collective(rng, (0, 1, 2, 3), "0", seq, None, 10.0 + seq).items():
            if r == 2 and seq >= 12:  # rank 2 enters seq 12 and is never heard of again
                recs = [x for x in recs if x.phase == PHASE_ENTRY and seq == 12]
            streams[r].extend(recs)
    batches = _batches(rng, streams, 4, shuffle=False)
    slow, fast, found = _compare(batches, rng, 4, blocks=True)
    assert fast.unmatched() == slow.unmatched() == 18  # seq 12 (entered, never done) .. 29
    missing = [f for f in found if f.kind == "missing_rank"]
    # once per set of missing ranks (checks that ran before every batch arrived saw others)
    assert len(missing) == len({tuple(f.culprits) for f in missing})
    [rank2] = [f for f in missing if f.culprits == [2]]
    assert rank2.seq >= 13
    # seq 12: every member entered, rank 2 never completed; once for the group
    [hang] = [f for f in found if f.kind == "hang"]
    assert hang.group == "0[0-3]" and hang.seq <= 12
    assert {f.kind for f in found} == {"missing_rank", "hang"}
    for e in (slow, fast):  # every open key was reported (or folded) once
        assert e.pending(float("inf"), True) == []


def test_a_rank_far_behind_is_evicted_and_counted_not_kept():
    """Memory stays bounded by max_span: the oldest open keys are dropped and counted, and
    the lagging rank's records for them are counted as late."""
    rng = random.Random(1)
    engine = Engine(4, fast=True, max_span=64)
    streams: dict[int, list[Record]] = {r: [] for r in range(4)}
    for seq in range(400):
        for r, recs in _collective(rng, (0, 1, 2, 3), "0", seq, None, float(seq)).items():
            streams[r].extend(recs)
    lagging = streams.pop(3)
    for b in _batches(rng, streams, 4, shuffle=False):
        engine.ingest(b)
    still_open = engine.unmatched()
    assert 0 < still_open <= 64
    assert engine.stats.evicted == 400 - still_open
    assert engine.fast is not None and engine.fast.tables[0].cap <= 128
    for b in _batches(rng, {3: lagging}, 4, shuffle=False):
        engine.ingest(b)
    assert engine.stats.late > 0
    # the lagging rank completes exactly the keys still open; the evicted ones stay gone
    assert engine.stats.verified == still_open and engine.unmatched() == 0


def test_cell_budget_evicts_the_oldest_rows():
    rng = random.Random(2)
    engine = Engine(4, fast=True, max_open_cells=4 * 50)
    streams: dict[int, list[Record]] = {r: [] for r in range(3)}
    for seq in range(200):
        for r, recs in _collective(rng, (0, 1, 2, 3), "0", seq, None, float(seq)).items():
            if r < 3:
                streams[r].extend(recs)
    for b in _batches(rng, streams, 4, shuffle=False):
        engine.ingest(b)
    assert engine.unmatched() <= 50
    assert engine.stats.evicted >= 150


def test_vectorised_tolerance_is_reduction_tolerance():
    """fastpath._tolerance (the checksum and reduce_scatter checks) mirrors
    verdicts.reduction_tolerance: keep them in step."""
    from commcheck.engine.ids import Ids

    ids = Ids()
    for dtype in ("float32", "bfloat16", "float64", "int64"):
        [sid] = ids.string_ids([dtype])
        for n, numel, a in ((2, 1, 0.5), (5, 4096, 3.0), (1024, 0, 1e6)):
            unit = ids.prop("unit")[np.array([sid])]
            vec = _tolerance(n, unit, np.array([numel], np.uint64), np.array([a]))
            assert vec[0] == reduction_tolerance(dtype, n, numel, a)
    assert _EPS == 2.0**-52


def test_goodbye_only_batches_do_not_disturb_the_fast_path():
    engine = Engine(2)
    engine.ingest(decode(encode(BatchBuilder("r", 0, "h", 2).control(GOODBYE, 0))))
    assert engine.stats.records == 0 and engine.unmatched() == 0


def _gathers(seed: int, trouble: str | None, keys: int = 40, clean: str = "ag_clean",
             oracle: Expect | None = None) -> list:
    rng = random.Random(seed)
    streams: dict[int, list[Record]] = {r: [] for r in range(5)}
    groups = [("0", tuple(range(5))), ("tp1", (2, 3, 4)), ("pp", (1, 3))]
    seqs = {g: 0 for g, _ in groups}
    for k in range(keys):
        name, ranks = groups[k % len(groups)]
        bad = trouble if k == keys // 2 else None
        for r, recs in _collective(rng, ranks, name, seqs[name], bad or clean, 100.0 + k,
                                   oracle).items():
            streams[r].extend(recs)
        seqs[name] += 1
    return _batches(rng, streams, 5, shuffle=False)


@pytest.mark.parametrize("clean", ["ag_clean", "rs_clean", "rs_avg", "rs_max", "a2a_clean",
                                   "a2a_uneven"])
def test_clean_gathers_and_scatters_are_decided_on_the_fast_path_and_free_chunks(clean):
    batches = _gathers(1, None, clean=clean)
    engine = Engine(5)
    exact_records, converted = [], []
    real, convert = engine.exact.record, engine.fast.convert
    engine.exact.record = lambda *a, **k: exact_records.append(a) or real(*a, **k)
    engine.fast.convert = lambda *a: converted.append(a) or convert(*a)
    found = engine.ingest_many(batches) + engine.finish()
    assert found == [] and engine.stats.verified == 40
    assert exact_records == [] and converted == []  # nothing took the exact path
    assert engine.fast.kept == {} and engine.fast.kept_refs == {}


@pytest.mark.parametrize("trouble, kind, clean", [
    ("ag_link", "link_corruption", "ag_clean"), ("ag_sender", "link_corruption", "ag_clean"),
    ("rs_bad", "reduction_error", "rs_clean"), ("rs_chunk", "reduction_error", "rs_clean"),
    ("a2a_link", "link_corruption", "a2a_clean"),
    ("a2a_sender", "link_corruption", "a2a_clean"),
    ("a2a_uneven_link", "link_corruption", "a2a_uneven"),
    ("a2a_dtype", "desync", "a2a_uneven")])
def test_a_corrupt_gather_or_scatter_is_found_with_its_chunks(trouble, kind, clean):
    """The row fails the fast check and goes to the exact path with the chunks the fast
    path kept: the same culprits (and links) as the exact engine names."""
    expect = Expect()
    batches = _gathers(2, trouble, clean=clean, oracle=expect)
    fast, slow = Engine(5), Engine(5, fast=False)
    got = fast.ingest_many(batches) + fast.finish()
    want = [f for b in batches for f in slow.ingest(b)] + slow.finish()
    assert _js(got) == _js(want)
    assert [m[0] for m in expect.must] and {m[0] for m in expect.must} == {kind}
    expect.check(got)  # the culprits the trouble names, not only some
    hits = [f for f in got if f.kind == kind]
    assert hits and all(f.culprits for f in hits)
    if kind == "link_corruption":
        assert all(f.detail.links for f in hits)
    assert fast.fast.kept == {}
