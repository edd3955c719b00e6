"""Same-run ratios for the 4-rank bench: one ratio per round, then their median and spread.

A round times a block of wrapped calls and a block of original calls back to back on the
same load, so the ratio of the two blocks is the figure a shared box can resolve; the
spread of those per-round ratios (interquartile range) says how far one run's median can
be trusted. Pure Python, no torch: ``launch/bench/bench_overhead.py`` uses it and
``tests/unit/test_benchstats.py`` pins it down.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), interpolated between the sorted values."""
    if not xs:
        raise ValueError("no values")
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


@dataclass(frozen=True)
class Ratio:
    """Per-round ratios wrapped/original of one case: median, quartiles, how many rounds."""

    median: float
    q1: float
    q3: float
    rounds: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def ratio(wrapped: list[float], original: list[float]) -> Ratio:
    """Round i compares ``wrapped[i]`` with ``original[i]`` (same round, same load)."""
    if len(wrapped) != len(original):
        raise ValueError("one wrapped and one original block per round")
    per_round = [w / o for w, o in zip(wrapped, original, strict=True) if o > 0]
    q1, med, q3 = quartiles(per_round)
    return Ratio(med, q1, q3, len(per_round))


def median_of_medians(runs: list[Ratio]) -> Ratio:
    """Several repeats of one case: the median of their medians, with the quartiles of those
    medians as the spread between repeats and the rounds of all repeats together."""
    q1, med, q3 = quartiles([r.median for r in runs])
    return Ratio(med, q1, q3, sum(r.rounds for r in runs))
