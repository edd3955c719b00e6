"""The 4-rank bench's figures: per-round ratios, their median and spread, repeats combined."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytestmark = pytest.mark.timeout(10)

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "bench", "benchstats.py")
_spec = importlib.util.spec_from_file_location("benchstats", _PATH)
benchstats = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("benchstats", benchstats)  # dataclasses look their module up
_spec.loader.exec_module(benchstats)


def test_ratio_is_taken_per_round_then_the_median():
    # round 2's original block was disturbed (slow): its ratio is an outlier the median ignores
    wrapped = [1.1, 2.2, 1.2, 1.05, 1.15]
    original = [1.0, 10.0, 1.0, 1.0, 1.0]
    r = benchstats.ratio(wrapped, original)
    assert r.rounds == 5
    assert r.median == pytest.approx(1.1)
    assert r.q1 == pytest.approx(1.05)
    assert r.q3 == pytest.approx(1.15)
    assert r.iqr == pytest.approx(0.1)


def test_same_times_give_one_with_no_spread():
    r = benchstats.ratio([2.0] * 8, [2.0] * 8)
    assert (r.median, r.iqr, r.rounds) == (1.0, 0.0, 8)


def test_rounds_must_pair_up():
    with pytest.raises(ValueError):
        benchstats.ratio([1.0, 1.0], [1.0])
    with pytest.raises(ValueError):
        benchstats.ratio([], [])


def test_median_of_medians_counts_every_round():
    runs = [benchstats.Ratio(1.3, 1.0, 1.6, 20), benchstats.Ratio(1.1, 1.0, 1.2, 30),
            benchstats.Ratio(1.2, 1.1, 1.3, 25)]
    m = benchstats.median_of_medians(runs)
    assert m.median == pytest.approx(1.2)
    assert (m.q1, m.q3) == (pytest.approx(1.15), pytest.approx(1.25))
    assert m.rounds == 75
    one = benchstats.median_of_medians(runs[:1])  # one repeat: no spread between repeats
    assert (one.median, one.iqr, one.rounds) == (1.3, 0.0, 20)
