"""Shared test plumbing: no collector or job started by a test outlives it."""

from __future__ import annotations

import pytest

from . import harness


@pytest.fixture(autouse=True)
def _reap_processes():
    yield
    harness.reap()
