"""What timing arrivals costs the collector: its ingest path in one process, with and
without the straggler analysis, interleaved.

    PYTHONPATH=. python launch/bench/bench_stragglers.py [RECORDS] [ROUNDS]

The bench's traffic (1024 ranks, ``commcheck bench collector``'s) is built first; each round
feeds it to a Pipeline (decode, engine, store ``none``) 64 messages at a time, once with
``--straggler off`` and once with the defaults, in alternating order; prints records per
CPU-second of each, the on/off ratios, and the share of the "on" runs' CPU spent timing
arrivals (measured inside ``Engine._time_arrivals``: it moves less with the box's load than
the rates). docs/ingest.md has the figures.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from commcheck.collector.bench import Plan, build
from commcheck.collector.pipeline import Pipeline, tune_process
from commcheck.collector.store import Store
from commcheck.engine import Engine
from commcheck.engine.stragglers import StragglerRules


def _timed(spent: list[float], arrivals):
    def timed(blk) -> None:
        t0 = time.thread_time()
        arrivals(blk)
        spent[0] += time.thread_time() - t0
    return timed


def run(msgs: list[bytes], ranks: int, mode: str, shares: list[float]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(ranks, stragglers=StragglerRules.parse(mode))
        spent = [0.0]
        engine._time_arrivals = _timed(spent, engine._time_arrivals)  # what the block calls
        pipe = Pipeline(engine, Store.create(Path(tmp) / "b.db", "none"))
        c0 = time.process_time()
        for j in range(0, len(msgs), 64):
            pipe.feed_many(msgs[j:j + 64])
        cpu = time.process_time() - c0
        n = pipe.engine.stats.records
        pipe.store.close()
    print(f"{mode}: {n:,} records, {cpu:.2f} CPU-s = {n / cpu:,.0f} records per CPU-second"
          + (f", {spent[0]:.2f} CPU-s timing arrivals ({spent[0] / cpu:.1%})"
             if mode == "on" else ""), flush=True)
    if mode == "on":
        shares.append(spent[0] / cpu)
    return n / cpu


def main() -> None:
    records = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    tune_process()
    plan = Plan(ranks=1024, records=records, t0=time.time() + 3600)
    msgs = build(plan, list(range(plan.ranks)))
    rates: dict[str, list[float]] = {"off": [], "on": []}
    shares: list[float] = []
    for i in range(rounds):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            rates[mode].append(run(msgs, plan.ranks, mode, shares))
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(f"median on {on:,.0f} / off {off:,.0f} = {on / off:.3f}; pairwise "
          f"{[round(a / b, 3) for a, b in zip(rates['on'], rates['off'], strict=True)]}; "
          f"timing arrivals {statistics.median(shares):.1%} of the on runs' CPU (median)")


if __name__ == "__main__":
    main()
