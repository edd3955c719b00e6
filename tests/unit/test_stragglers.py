"""Stragglers from hand-made timings: who arrived last, from each member's own wait.

Each simulated step every rank arrives at a collective (a common start, its own jitter,
and an extra delay for a slow rank); the collective completes on all members once the last
arrived plus a transfer time; each rank stamps t_enter/t_exit on its host's clock, which
may be shifted by seconds. The records go through the real wire codec into a real Engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from commcheck.collector.report import _how_far
from commcheck.engine import Engine, Kind
from commcheck.engine.stragglers import RulesError, StragglerRules, rank_rows
from commcheck.wire import BatchBuilder, decode, encode

from ..records import rec

STEP = 0.2


def host_of(rank: int) -> str:
    return f"node{rank // 2}"


def simulate(steps: int, n: int = 4, slow: dict[int, tuple[int, int, float]] | None = None,
             offsets: dict[str, float] | None = None, seed: int = 0, jitter: float = 0.004,
             groups: list[tuple[str, tuple[int, ...]]] | None = None, transfer=None,
             p2p_skew: bool = False, rules: StragglerRules | None = None,
             per_batch: int = 25, calls: int = 1):
    """Feed ``steps`` steps of one all_reduce per group to an engine; ``slow``: rank ->
    (first step, last step, extra seconds); ``transfer(group_ranks, hosts, step)``: seconds;
    ``calls``: collectives per step and group, the later ones in lockstep after the first."""
    rng = np.random.default_rng(seed)
    slow, offsets = slow or {}, offsets or {}
    groups = groups or [("0", tuple(range(n)))]
    engine = Engine(n, stragglers=rules)
    pending: dict[int, list] = {r: [] for r in range(n)}
    found = []
    seqs = {g: 0 for g in groups}
    for step in range(steps):
        t0 = 1000.0 + step * STEP
        arrive = {r: t0 + rng.exponential(jitter) for r in range(n)}
        for r, (a, b, extra) in slow.items():
            if a <= step < b:
                arrive[r] += extra
        for g in [g for g in groups for _ in range(calls)]:
            name, ranks = g
            hosts = {host_of(r) for r in ranks}
            xfer = transfer(ranks, hosts, step) if transfer else 0.001
            if p2p_skew:  # a pipeline: the later stage always waits for the earlier one
                arrive = {r: t0 + 0.05 * (len(ranks) - 1 - r) for r in range(n)}
            done = max(arrive[r] for r in ranks) + xfer
            for r in ranks:
                off = offsets.get(host_of(r), 0.0)
                pending[r].append(rec(seq=seqs[g], group_name=name, group_ranks=ranks,
                                      step=step, t_enter=arrive[r] + off,
                                      t_exit=done + off + rng.uniform(0, 1e-4),
                                      t_done=done + off))
            seqs[g] += 1
            if calls > 1:  # the next call: everyone leaves this one together
                arrive = {r: done + rng.exponential(jitter) for r in range(n)}
        if step % per_batch == per_batch - 1 or step == steps - 1:
            for r in range(n):
                b = BatchBuilder("r", r, host_of(r), n)
                found += engine.ingest(decode(encode(b.build(pending[r], seq=step + 1))))
                pending[r] = []
    return engine, [f for f in found if f.kind is Kind.STRAGGLER]


def test_a_healthy_job_has_no_straggler():
    for seed in range(3):
        _, found = simulate(300, seed=seed)
        assert found == []


def test_a_rank_slowed_from_step_100_is_named_once_and_its_episode_ends():
    engine, found = simulate(500, slow={2: (100, 300, 0.04)})
    assert len(found) == 1
    f = found[0]
    d = f.detail
    assert (f.culprits, f.hosts, d.cause, d.rank, d.host) == ([2], ["node1"], "rank", 2, "node1")
    assert 100 <= d.start_step <= 110 and f.step == d.start_step
    assert f.seq < 100 + 2 * 64  # found within the first windows after the onset
    assert d.waiting_share >= 0.6 and d.wall_pct >= 5 and d.groups == ["0[0-3]"]
    assert d.waited_at == "train.py:10 main"
    assert d.median_gap_ms > 20
    assert d.ended and 300 <= d.end_step <= 300 + 64 + 25  # a window, and a batch of steps
    assert d.cost_s > 3 * 200 * 0.03  # three others, 200 slow steps, >= 30 ms each
    assert 50 < d.cost_pct <= 100
    rows = rank_rows(engine.lateness.counters())
    assert rows[2]["last"] > 200 and rows[2]["calls"] == 500
    assert rows[2]["cost_us"] > 2 * max(rows[r]["cost_us"] for r in (0, 1, 3))


def test_a_rank_late_only_to_the_first_of_four_lockstep_calls_is_named():
    """It arrives last in ~40 % of the calls, but the others' waiting is nearly all for it."""
    _, found = simulate(300, slow={3: (60, 300, 0.05)}, calls=4)
    [f] = found
    assert f.culprits == [3] and 60 <= f.detail.start_step <= 63
    assert f.detail.last_share < 0.6 <= f.detail.waiting_share
    _, found = simulate(300, calls=4, seed=3)
    assert found == []


def test_the_episode_is_stored_with_its_end():
    engine, found = simulate(400, slow={1: (50, 200, 0.05)})
    changed = engine.stragglers.take_changed()
    assert [f.detail.ended for f in changed] == [True]
    assert changed[0] is found[0]


def test_clocks_seconds_apart_make_no_straggler_and_do_not_hide_one():
    offsets = {"node1": 7.5, "node0": -3.0}
    _, found = simulate(400, offsets=offsets)
    assert found == []
    _, found = simulate(400, offsets=offsets, slow={0: (60, 400, 0.04)})
    assert [(f.culprits, f.detail.host) for f in found] == [([0], "node0")]
    assert found[0].detail.start_step >= 60


def test_waits_all_alike_name_nobody():
    _, found = simulate(200, jitter=0.0, transfer=lambda *_: 0.0)
    assert found == []


def test_a_slowdown_too_small_to_matter_is_not_named():
    _, found = simulate(400, slow={3: (0, 400, 0.004)}, jitter=0.0005)
    assert found == []  # last every time, but < 5 % of the others' time


def test_a_pipelines_stage_skew_is_not_a_straggler():
    """Stage 0 always arrives last at the world all_reduce after the schedule; its send/recv
    partner is in the group: waiting there is the schedule's design."""
    groups = [("p2p:0->1", (0, 1)), ("0", (0, 1))]
    _, found = simulate(300, n=2, groups=groups, p2p_skew=True)
    assert found == []
    _, found = simulate(300, n=2, groups=[("0", (0, 1))], p2p_skew=True)
    assert [f.culprits for f in found] == [[0]]  # without the pipeline, it would be named


def _pairs() -> list[tuple[str, tuple[int, ...]]]:
    """2-rank groups across three hosts (ranks 0,1 node0; 2,3 node1; 4,5 node2)."""
    return [(f"pair{a}{b}", (a, b)) for a, b in ((0, 2), (1, 4), (3, 5), (0, 5))]


def test_a_slow_link_names_the_node_pair_not_a_rank():
    def transfer(ranks, hosts, step):
        return 0.03 if hosts == {"node0", "node1"} else 0.001

    _, found = simulate(300, n=6, groups=_pairs(), transfer=transfer)
    assert len(found) == 1
    d = found[0].detail
    assert (d.cause, d.link, found[0].culprits, d.rank) == ("link", ["node0", "node1"], [],
                                                            None)
    assert found[0].hosts == ["node0", "node1"] and d.ranks == [0, 2]
    assert d.median_gap_ms > 25 and d.baseline_ms < 2


def _one_per_node() -> list[tuple[str, tuple[int, ...]]]:
    """A 2-rank group between every two of three hosts (ranks 0 node0, 2 node1, 4 node2)."""
    return [(f"pair{a}{b}", (a, b)) for a, b in ((0, 2), (0, 4), (2, 4))]


def _node2_slow_from_100(ranks, hosts, step):
    return 0.03 if "node2" in hosts and step >= 100 else 0.001


def test_a_slow_nodes_links_name_the_node_with_three_hosts():
    # two of the three host pairs are slow: a pair against the others' median never fires
    _, found = simulate(300, n=6, groups=_one_per_node(), transfer=_node2_slow_from_100)
    assert len(found) == 1, [f.detail for f in found]
    f, d = found[0], found[0].detail
    assert (d.cause, d.link, d.host, f.hosts, f.culprits, d.rank) == \
        ("link", ["node2"], "node2", ["node2"], [], None)
    assert d.ranks == [0, 2, 4] and d.groups == ["pair04[0,4]", "pair24[2,4]"]
    assert 100 <= d.start_step <= 110 and f.step == d.start_step
    assert d.median_gap_ms > 25 and d.baseline_ms < 2
    assert _how_far(f).startswith("slow links of node2 (ranks 0,2,4): exchanges take ")


def test_a_rank_late_after_its_slow_exchanges_is_the_links_not_a_rank():
    # node2's rank comes late to everything after its slow exchanges (a 3-rank group too):
    # its lateness is the link's
    groups = [*_one_per_node(), ("all", (0, 2, 4))]
    late = {4: (100, 300, 0.03)}
    _, found = simulate(300, n=6, groups=groups, transfer=_node2_slow_from_100, slow=late)
    assert [(f.detail.cause, f.hosts) for f in found] == [("link", ["node2"])]
    _, found = simulate(300, n=6, groups=groups, slow=late)  # the same lateness, fast links
    assert [(f.detail.cause, f.culprits) for f in found] == [("rank", [4])]


def test_a_slow_rank_in_pair_groups_is_a_rank_not_a_link():
    _, found = simulate(300, n=6, groups=_pairs(), slow={4: (0, 300, 0.04)})
    assert {(f.detail.cause, tuple(f.culprits)) for f in found} == {("rank", (4,))}


def test_healthy_pair_groups_have_no_straggler():
    _, found = simulate(300, n=6, groups=_pairs())
    assert found == []


def test_rules_parse_and_refuse():
    assert StragglerRules.parse("") == StragglerRules()
    assert not StragglerRules.parse("off").enabled
    r = StragglerRules.parse("window=32, majority=0.75,cost=0.1")
    assert (r.window, r.majority, r.cost) == (32, 0.75, 0.1)
    for bad in ("window=3", "majority=0.4", "cost=2", "speed=1", "window=x", "nonsense"):
        with pytest.raises(RulesError):
            StragglerRules.parse(bad)


def test_off_raises_nothing():
    _, found = simulate(300, slow={2: (0, 300, 0.05)}, rules=StragglerRules(enabled=False))
    assert found == []


def test_a_straggler_is_stored_updated_and_read_back_as_its_type(tmp_path):
    """Through a real Pipeline and Store: the finding, its end written at the next
    commit, the per-rank and per-host tables, the JSON round trip (as shards send it)."""
    from commcheck.collector.pipeline import Pipeline
    from commcheck.collector.report import load, to_json
    from commcheck.collector.store import Store
    from commcheck.engine import Finding
    from commcheck.engine.findings import Straggler

    engine, found = simulate(400, slow={3: (40, 250, 0.05)})
    store = Store.create(tmp_path / "run.db")
    pipe = Pipeline(engine, store)
    store.add_findings(found)
    engine.stragglers.changed.clear()
    found[0].detail.ended = False  # as stored while the episode lasted
    store.add_findings([])
    store.update_finding_detail(found[0])
    found[0].detail.ended = True
    engine.stragglers.changed[id(found[0])] = found[0]
    pipe.persist()
    findings, summary = load(Store.open(tmp_path / "run.db"))
    assert [type(f.detail) for f in findings] == [Straggler]
    assert findings[0] == found[0] and findings[0].detail.ended
    back = Finding.from_json(to_json(findings, summary)["findings"][0])
    assert back == found[0]
    top = summary.lateness[0]
    assert (top.rank, top.host, top.collectives) == (3, "node1", 400)
    assert top.last_pct > 50 and 25 <= top.median_gap_ms <= 100
    assert [h.host for h in summary.lateness_by_host] == ["node1", "node0"]
    assert summary.lateness_by_host[0].ranks == [2, 3]
    assert summary.first_divergence is None  # a straggler is no divergence


def test_prometheus_shows_each_ranks_wait_and_last_arrivals(tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from commcheck.collector.daemon import Collector, CollectorOptions

    c = Collector(CollectorOptions(bind="tcp://127.0.0.1:*", world_size=4,
                                   db=str(tmp_path / "x.db"), metrics="127.0.0.1:0"))
    try:
        msgs = []
        for rank in range(4):  # rank 2 enters 50 ms after the others, 10 times
            late = 0.05 if rank == 2 else 0.0
            recs = [rec(seq=i, t_enter=100.0 + i + late, t_exit=100.06 + i)
                    for i in range(10)]
            b = BatchBuilder("r", rank, host_of(rank), 4)
            msgs.append((f"relay{rank}".encode(), encode(b.build(recs, seq=0))))
        c.ingest(msgs)
        c.publish_metrics()
        with urllib.request.urlopen(c.metrics.url, timeout=5) as resp:
            text = resp.read().decode()
        assert "lateness" in str(c.view().columns[0]._cells)
    finally:
        c.metrics.close()
        c.receiver.close(linger=0)
        c.pipeline.stop()
        c.store.close()
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert m[("commcheck_rank_last_arrivals_total", (("host", "node1"), ("rank", "2")))] == 10
    assert m[("commcheck_rank_last_arrivals_total", (("host", "node0"), ("rank", "0")))] == 0
    assert m[("commcheck_rank_wait_seconds_total", (("host", "node0"), ("rank", "0")))] == \
        pytest.approx(0.6, abs=1e-3)
    assert m[("commcheck_rank_wait_seconds_total", (("host", "node1"), ("rank", "2")))] == \
        pytest.approx(0.1, abs=1e-3)


def test_settings_come_from_the_option_the_variable_or_the_config_file(tmp_path, monkeypatch,
                                                                       capsys):
    from commcheck.cli import _straggler_rules, main

    monkeypatch.delenv("COMMCHECK_STRAGGLER", raising=False)
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"straggler": "window=32", "hash": true}')
    monkeypatch.setenv("COMMCHECK_CONFIG", str(cfg))
    assert _straggler_rules("") == "window=32"
    from commcheck.rank.config import load_config

    assert load_config(env={"COMMCHECK_CONFIG": str(cfg)}).straggler == "window=32"  # ranks
    assert _straggler_rules("cost=0.2") == "cost=0.2"
    monkeypatch.setenv("COMMCHECK_STRAGGLER", "off")
    assert _straggler_rules("") == "off"
    for where, setting in (("--straggler", ["--straggler", "speed=3"]),
                           ("$COMMCHECK_STRAGGLER", [])):
        monkeypatch.setenv("COMMCHECK_STRAGGLER", "window=2")
        rc = main(["collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "1", "--db",
                   str(tmp_path / "x.db"), "--no-live", *setting])
        lines = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(
            f"commcheck: error: {where}: straggler setting"), lines
    monkeypatch.delenv("COMMCHECK_STRAGGLER")
    cfg.write_text('{"straggler": "majority=2"}')
    rc = main(["collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "1", "--db",
               str(tmp_path / "x.db"), "--no-live"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and str(cfg) in lines[0], lines
    assert not (tmp_path / "x.db").exists()  # refused before anything was made
    rc = main(["bench", "collector", "--straggler", "window=x"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "window='x'" in lines[0], lines


def test_an_open_episode_survives_a_collector_restart():
    """Snapshot mid-episode (as every commit does), load it, go on: the same episode ends."""
    from commcheck.collector import snapshot

    engine, found = simulate(150, slow={1: (40, 400, 0.05)})
    assert [f.detail.ended for f in found] == [False]
    back = snapshot.load(snapshot.dump(engine))
    [episode] = back.stragglers.open.values()
    assert episode.finding == found[0]
    rng = np.random.default_rng(9)
    for first in range(150, 300, 25):  # the slowdown is over
        for r in range(4):
            recs = [rec(seq=s, step=s, t_enter=1000.0 + s * STEP + rng.exponential(0.004),
                        t_exit=1000.0 + s * STEP + 0.02) for s in range(first, first + 25)]
            b = BatchBuilder("r", r, host_of(r), 4)
            back.ingest(decode(encode(b.build(recs, seq=first))))
    assert episode.finding.detail.ended and episode.finding.detail.end_step >= 150


def test_an_episode_found_late_or_among_noise_starts_at_its_onset():
    """20 ms of jitter a call: a verdict can come a window or more after the onset, and
    the rank is sometimes far behind before it. The start is placed over the windows kept
    before the judged one, at the last clear rise of its late arrivals (seeds 0 and 2 gave
    steps 109 and 73 when only the judged window placed it)."""
    starts = []
    for seed in range(8):
        _, found = simulate(140, slow={3: (60, 300, 0.1)}, calls=4, seed=seed, jitter=0.02)
        assert [f.culprits for f in found] == [[3]]
        starts.append(found[0].detail.start_step)
    assert all(57 <= s <= 64 for s in starts), starts


def test_two_ranks_with_the_same_noise_are_no_straggler_and_a_slow_one_is():
    """Two ranks of a loaded host take turns arriving last (each about half the time), and
    a few long stalls can put most of the waiting on one: chance, not a straggler (seeds
    0-4 gave 1-4 findings each before the chance test). A rank slowed by 50 ms is named."""
    for seed in range(5):
        _, found = simulate(400, n=2, seed=seed, jitter=0.01, calls=2)
        assert found == []
    _, found = simulate(300, n=2, seed=0, jitter=0.01, calls=2, slow={1: (60, 300, 0.05)})
    assert [(f.culprits, f.detail.cause) for f in found] == [([1], "rank")]
    assert 56 <= found[0].detail.start_step <= 64
