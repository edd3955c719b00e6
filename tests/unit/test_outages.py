"""Outages between a relay and the collector (issue 18): measured by acknowledgements,
summed into the ranks' status, one report line per relay."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from commcheck.collector.report import outages, render
from commcheck.collector.store import RankRow
from commcheck.engine.findings import Summary
from commcheck.relay.link import Outages


def test_no_ack_while_messages_wait_is_an_outage_and_a_short_gap_is_not():
    o = Outages(least=5.0)
    o.tick(0.0, acked=False, waiting=True)
    o.tick(2.0, acked=True, waiting=True)  # a 2 s gap: a busy collector, not an outage
    assert o.total(3.0) == (0.0, 0)
    o.tick(14.0, acked=False, waiting=True)  # 12 s without an ack: counted while it lasts
    assert o.total(14.0) == (12.0, 1)
    o.tick(15.0, acked=True, waiting=False)
    o.tick(40.0, acked=False, waiting=False)  # nothing to deliver: nothing unreachable
    assert o.total(40.0) == (13.0, 1)


def test_an_outage_is_one_line_per_relay():
    counters = {"unreachable_ms.2": 10200, "outages.2": 1, "resent.2": 50,
                "unreachable_ms.3": 10200, "outages.3": 1, "resent.3": 51,
                "unreachable_ms.0": 400}  # under a second: not shown
    ranks = [RankRow(run="r", rank=r, host="n", node=0, hello=True, goodbye=True,
                     records=1, counters={"dropped": 0}) for r in range(4)]
    got = outages(counters, ranks)
    assert [(o.ranks, o.seconds, o.resent, o.dropped) for o in got] == [([2, 3], 10.2, 101, 0)]
    summary = Summary(suspects=[], link_matrix=[], findings=0, records=4, verified=2,
                      unmatched=0, rejected={}, runs=["r"], ranks=4, ranks_said_goodbye=4,
                      dropped_on_ranks=0, spilled_on_ranks=0, not_checked_on_ranks=0,
                      bypassed={}, by_kind={}, by_rank={}, by_host={},
                      first_divergence=None, outages=got)
    out = StringIO()
    render([], summary, Console(file=out, width=200))
    assert ("ranks 2,3 could not reach the collector for 10.2 s; 101 batches re-sent; "
            "nothing lost") in out.getvalue()
