"""Shared test plumbing: no collector or job started by a test outlives it, and under
pytest-xdist (``make test``) each test file runs whole on one worker (docs/testing.md)."""

from __future__ import annotations

import pytest

from . import harness

# Files whose tests share one session-scoped job (tests/integration/conftest.py): one
# worker runs them together, so the job starts once, as in a serial run.
SHARED_JOB = {"test_offline.py": "test_spine.py", "test_relay.py": "test_dying.py"}


@pytest.fixture(autouse=True)
def _reap_processes():
    yield
    harness.reap()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile``, with the files of one shared job as one unit, handed out in
    collection order: the integration files (up to ~1.5 min each) first, the short unit
    files last, where they even out the workers' ends."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            folder, _, name = nodeid.split("::", 1)[0].rpartition("/")
            return f"{folder}/{SHARED_JOB.get(name, name)}"

    config.option.loadscopereorder = False
    return ByFile(config, log)
