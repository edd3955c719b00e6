"""Everything here starts processes (torchrun, a collector, senders) or runs for seconds:
marked ``integration``, run by ``make test`` and CI, not by ``make check``."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)
