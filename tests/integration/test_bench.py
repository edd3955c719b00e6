"""The collector benchmark, batch-blob storage and sharding, at small sizes."""

from __future__ import annotations

import json
import time

import pytest

from commcheck.cli import main
from commcheck.collector.bench import (
    _OP_A2A,
    _OP_RS,
    Plan,
    _calls,
    build,
    expected_records,
    groups_of,
    run_collector,
    run_in_process,
)
from commcheck.collector.pipeline import Pipeline
from commcheck.collector.shards import ShardedPipeline, shard_of
from commcheck.collector.store import Store
from commcheck.engine import Engine
from commcheck.engine.model import group_label

pytestmark = pytest.mark.timeout(180)


def _plan(**kw) -> Plan:
    return Plan(**{"ranks": 64, "records": 40_000, "batch": 128, "t0": time.time() + 3600,
                   **kw})


def _key(f) -> tuple:
    return (f.kind, f.group, f.seq, tuple(f.culprits), f.ambiguous)


def _injected(plan: Plan) -> list[tuple]:
    """The findings --mismatch asks for, as _key tuples, sorted: in every group a corrupted
    call ran on, one member's output differs (its hash; a reduce_scatter's sum), found as
    value_mismatch (reduction_error) naming that member, or in a group of two as a tie
    naming both. The all_to_alls of --moe are never corrupted."""
    calls = _calls(plan)
    groups: list[dict[str, tuple[int, ...]]] = [{}, {}, {}]  # world, TP, DP instances
    for rank in range(plan.ranks):
        for kind, (name, ranks) in enumerate(groups_of(plan, rank)):
            groups[kind][name] = tuple(ranks)
    out = []
    for k in calls["bad"].nonzero()[0].tolist():
        op = int(calls["op"][k])
        if op == _OP_A2A:
            continue
        for name, ranks in groups[int(calls["kind"][k])].items():
            culprit = ranks[int(calls["culprit"][k]) % len(ranks)]
            kind = "reduction_error" if op == _OP_RS else "value_mismatch"
            tie = kind == "value_mismatch" and len(ranks) == 2
            out.append((kind, group_label(name, ranks), int(calls["seq"][k]),
                        ranks if tie else (culprit,), tie))
    return sorted(out)


def _pipeline(tmp_path, name: str, fast: bool = True, records: str = "rows") -> Pipeline:
    return Pipeline(Engine(64, fast=fast), Store.create(tmp_path / name, records))


def test_synthetic_traffic_is_clean_and_complete(tmp_path):
    plan = _plan()
    pipe = _pipeline(tmp_path, "a.db")
    msgs = build(plan, list(range(plan.ranks)))
    for i in range(0, len(msgs), 16):
        pipe.feed_many(msgs[i:i + 16])
    pipe.close_run(time.time())
    st = pipe.engine.stats
    assert st.records == expected_records(plan)
    assert st.findings == 0 and pipe.engine.unmatched() == 0
    assert st.verified > 0 and pipe.engine.open == {}  # every key on the fast path


@pytest.mark.parametrize("traffic", ["", "fsdp", "moe"])
def test_injected_mismatches_are_found_by_both_engines(tmp_path, traffic):
    plan = _plan(mismatch=0.05, **({traffic: True} if traffic else {}))
    msgs = build(plan, list(range(plan.ranks)))
    found, keys = {}, {}
    for fast in (True, False):
        pipe = _pipeline(tmp_path, f"{fast}.db", fast=fast)
        for i in range(0, len(msgs), 16):
            pipe.feed_many(msgs[i:i + 16])
        found[fast] = [json.dumps(f.to_json()) for f in pipe.store.findings()]
        keys[fast] = sorted(map(_key, pipe.store.findings()))
    assert found[True] == found[False]
    assert keys[True] == _injected(plan) and len(keys[True]) > 10


@pytest.mark.parametrize("mode", ["file", "batches"])
def test_batch_modes_keep_every_record_and_the_report_counts_them(tmp_path, mode):
    plan = _plan(records=10_000)
    pipe = _pipeline(tmp_path, "b.db", records=mode)
    for m in build(plan, list(range(plan.ranks))):
        pipe.feed(m)
    pipe.persist()
    pipe.store.close()
    store = Store.open(tmp_path / "b.db")
    assert store.summary().records == expected_records(plan)
    assert store.summary().runs == ["bench"]
    assert sum(len(b.records) for b in store.batches()) == expected_records(plan)
    assert main(["report", str(tmp_path / "b.db")]) == 0


def test_none_mode_stores_findings_only(tmp_path):
    pipe = _pipeline(tmp_path, "n.db", records="none")
    plan = _plan(records=10_000, mismatch=0.2)
    for m in build(plan, list(range(64))):
        pipe.feed(m)
    pipe.persist()
    assert pipe.store.summary().records == 0
    assert sorted(map(_key, pipe.store.findings())) == _injected(plan)


def test_shards_find_what_one_engine_finds(tmp_path):
    plan = _plan(mismatch=0.05)
    msgs = build(plan, list(range(plan.ranks)))
    one = _pipeline(tmp_path, "one.db")
    sharded = ShardedPipeline(2, Store.create(tmp_path / "two.db"), plan.ranks)
    try:
        for pipe in (one, sharded):
            for i in range(0, len(msgs), 16):
                pipe.feed_many(msgs[i:i + 16])
            pipe.close_run(time.time())
            pipe.persist()
    finally:
        sharded.stop()
    assert sorted(map(_key, sharded.store.findings())) == sorted(map(_key, one.store.findings()))
    assert sorted(map(_key, one.store.findings())) == _injected(plan)
    c1, c2 = one.counters(), sharded.counters()
    for k in ("records", "verified", "findings", "unmatched"):
        assert c1[k] == c2[k], k
    assert {k: v for k, v in sharded.shard_counters[0].items() if k == "records"}["records"] > 0
    assert sharded.shard_counters[1]["records"] > 0  # both shards got work
    summary = Store.open(tmp_path / "two.db").summary()
    assert summary.records == expected_records(plan)
    assert len(summary.ranks) == plan.ranks and all(r.goodbye for r in summary.ranks)


def test_probe_groups_of_one_replica_set_share_a_shard():
    ranks = [0, 1, 2, 3]
    assert len({shard_of("r", f"grad:layer{i}.weight", ranks, 4) for i in range(50)}) == 1
    assert len({shard_of("r", f"tp{i}", ranks, 4) for i in range(50)}) > 1


def test_bench_collector_end_to_end(tmp_path):
    """The bench runs the collector with collect's default storage (the records file), and
    every record it took can be queried back."""
    from commcheck.collector.daemon import CollectorOptions
    from commcheck.collector.store import DEFAULT_RECORDS

    assert DEFAULT_RECORDS == "file" and CollectorOptions("", 1, "").records == "file"
    plan = _plan(records=20_000, mismatch=0.02)
    r = run_collector(plan, senders=2, db=str(tmp_path / "c.db"))
    assert "records=file" in r.mode
    assert r.records == expected_records(plan) and r.rate > 0 and r.rss_mib > 0
    assert r.findings == len(_injected(plan)) > 0 and r.unmatched == 0
    assert run_in_process(plan).verified == r.verified
    store = Store.open(tmp_path / "c.db")
    assert store.summary().records == expected_records(plan)
    assert store.conn.execute("SELECT COUNT(*) FROM main.records").fetchone()[0] == 0
    assert store.query(rank=5).execute("SELECT COUNT(*), COUNT(DISTINCT rank) FROM records"
                                       ).fetchone() == (expected_records(plan) // 64, 1)


def test_bench_cli_prints_rates(capsys):
    assert main(["bench", "collector", "--ranks", "32", "--records", "5000", "--store",
                 "none", "--senders", "1"]) == 0
    out = capsys.readouterr().out
    assert "records/s" in out and "peak RSS" in out
    assert main(["bench", "collector", "--store", "bogus"]) == 2


def test_restarted_shards_resume_and_find_each_finding_once(tmp_path):
    """A sharded collector restarted on its database resumes its shards from their committed
    snapshots: collectives open at the restart still match, and findings stored before are
    not stored again."""
    plan = _plan(mismatch=0.05)
    msgs = build(plan, list(range(plan.ranks)))
    half = len(msgs) // 2
    one = _pipeline(tmp_path, "one.db")
    one.feed_many(msgs)
    one.close_run(time.time())
    before = ShardedPipeline(2, Store.create(tmp_path / "two.db"), plan.ranks)
    try:
        before.feed_many(msgs[:half])
        before.persist()
    finally:
        before.stop()
        before.store.close()
    stored_before = len(Store.open(tmp_path / "two.db").findings())
    assert 0 < stored_before < len(one.store.findings())
    after = ShardedPipeline(2, Store.create(tmp_path / "two.db"), plan.ranks)
    try:
        parts = after.store.snapshot()
        assert len(parts) == 3  # the router's books and two shards
        after.resume(parts)
        for i in range(half, len(msgs), 16):
            after.feed_many(msgs[i:i + 16])
        after.close_run(time.time())
        after.persist()
    finally:
        after.stop()
    assert sorted(map(_key, after.store.findings())) == sorted(map(_key, one.store.findings()))
    assert sorted(map(_key, one.store.findings())) == _injected(plan)
    assert after.counters()["unmatched"] == 0 == one.counters()["unmatched"]


def test_moe_traffic_is_verified_on_the_fast_path_like_the_exact_engine():
    plan = _plan(mismatch=0.05, moe=True)
    fast, exact = run_in_process(plan), run_in_process(plan, fast=False)
    assert (fast.findings, fast.verified, fast.unmatched) == \
        (exact.findings, exact.verified, exact.unmatched)
    assert fast.findings == len(_injected(plan)) > 0  # the world's and DP groups'
    assert fast.verified > 0 and fast.unmatched == 0


def test_fsdp_traffic_is_decided_like_the_exact_engine():
    """bench --fsdp: TP calls are all_gathers and reduce_scatters with per-member chunks;
    clean ones verify on the fast path, corrupted ones give the exact engine's findings."""
    plan = _plan(mismatch=0.05, fsdp=True)
    fast, exact = run_in_process(plan), run_in_process(plan, fast=False)
    assert fast.findings == exact.findings == len(_injected(plan)) > 0
    assert fast.verified == exact.verified > 0 and fast.unmatched == exact.unmatched == 0
