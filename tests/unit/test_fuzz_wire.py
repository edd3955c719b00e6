"""The decoder under hostile input, in process (fast): every kind of bad message is either
rejected with a WireError or decodes into a self-consistent batch."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commcheck.wire import WireError

from ..fuzzing import HOSTILE, TEMPLATES, classify

pytestmark = pytest.mark.timeout(60)

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def test_templates_are_valid():
    for t in TEMPLATES:
        assert not isinstance(classify(t), WireError)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_decoder_keeps_its_contract(kind):
    @FUZZ
    @given(HOSTILE[kind])
    def check(data: bytes) -> None:
        classify(data)

    check()


@pytest.mark.parametrize("kind", ["wrong_version", "huge_lengths"])
def test_always_rejected(kind):
    @FUZZ
    @given(HOSTILE[kind])
    def check(data: bytes) -> None:
        assert isinstance(classify(data), WireError)

    check()


@FUZZ
@given(st.sampled_from(TEMPLATES), st.integers(1, 4))
def test_trailing_garbage_is_rejected(template, n):
    assert isinstance(classify(template + b"\x00" * n), WireError)
