"""Stragglers with ``collect --shards``: each shard judges its own groups' windows, and the
collector names a slow rank exactly as one engine does, once; a healthy job, nobody.

Hand-made timings (each rank's wait on its own clock, as in ``tests/unit/test_stragglers``)
over two groups of the same four ranks that live on different shards, through the wire
codec into a real ShardedPipeline (two shard processes) and a one-engine Pipeline.
"""

from __future__ import annotations

import numpy as np
import pytest

from commcheck.collector.pipeline import Pipeline
from commcheck.collector.shards import ShardedPipeline, shard_of
from commcheck.collector.store import Store
from commcheck.engine import Engine, Kind
from commcheck.wire import BatchBuilder, encode

from ..records import rec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N, STEPS, PER_BATCH = 4, 300, 25
GROUPS = [("0", (0, 1, 2, 3)), ("dp1", (0, 1, 2, 3))]  # crc32 routes them to shards 0 and 1


def messages(run: str, slow: dict[int, tuple[int, int, float]], seed: int) -> list[bytes]:
    """Each step every rank computes, then arrives at an all_reduce, once per group (its
    own jitter; ``slow``: rank -> (first step, last step, extra seconds of each compute));
    the call completes on all once the last arrived. One message per rank every
    ``PER_BATCH`` steps."""
    rng = np.random.default_rng(seed)
    pending: dict[int, list] = {r: [] for r in range(N)}
    out = []
    t = 1000.0
    for step in range(STEPS):
        for name, ranks in GROUPS:
            arrive = {r: t + 0.1 + rng.exponential(0.004) for r in range(N)}
            for r, (a, b, extra) in slow.items():
                if a <= step < b:
                    arrive[r] += extra
            done = t = max(arrive[r] for r in ranks) + 0.001
            for r in ranks:
                pending[r].append(rec(seq=step, group_name=name, group_ranks=ranks, step=step,
                                      t_enter=arrive[r], t_exit=done + rng.uniform(0, 1e-4),
                                      t_done=done))
        if step % PER_BATCH == PER_BATCH - 1:
            for r in range(N):
                b = BatchBuilder(run, r, f"node{r // 2}", N)
                out.append(encode(b.build(pending[r], seq=step // PER_BATCH + 1)))
                pending[r] = []
    return out


def _stragglers(pipe) -> list:
    return [f for f in pipe.store.findings() if f.kind is Kind.STRAGGLER]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """The stored stragglers of a slow and a healthy job, sharded and with one engine."""
    tmp = tmp_path_factory.mktemp("sharded")
    assert sorted(shard_of("r", name, list(ranks), 2) for name, ranks in GROUPS) == [0, 1]
    jobs = {"slow": messages("r", {2: (60, 200, 0.05)}, seed=0), "clean": messages("r", {}, 1)}
    sharded = {job: ShardedPipeline(2, Store.create(tmp / f"{job}2.db"), N) for job in jobs}
    out = {}
    try:
        for job, msgs in jobs.items():
            one = Pipeline(Engine(N), Store.create(tmp / f"{job}1.db"))
            for pipe in (one, sharded[job]):
                for i in range(0, len(msgs), 8):
                    pipe.feed_many(msgs[i:i + 8])
                pipe.close_run(2000.0)
                pipe.persist()
            out[job] = (_stragglers(one), _stragglers(sharded[job]))
    finally:
        for pipe in sharded.values():
            pipe.stop()
    return out


def test_a_slow_rank_is_named_once_with_shards_as_with_one_engine(found):
    """Both shards find rank 2 (slow from step 60 to 200) in their group; stored once, with
    both groups, as one engine stores it. Where a window is judged depends on how many
    collectives a block finishes (a shard takes bursts), so the steps agree to a window."""
    one, sharded = found["slow"]
    for f in (*one, *sharded):
        assert (f.culprits, f.hosts, f.detail.cause, f.detail.rank, f.detail.host) == \
            ([2], ["node1"], "rank", 2, "node1")
        assert f.detail.groups == ["0[0-3]", "dp1[0-3]"]
        assert 60 <= f.detail.start_step == f.step <= 66
        assert f.detail.ended and 200 <= f.detail.end_step <= 200 + 2 * 64
    assert len(one) == len(sharded) == 1


def test_a_healthy_job_has_no_straggler_with_shards(found):
    assert found["clean"] == ([], [])
