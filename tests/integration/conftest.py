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


@pytest.fixture(scope="session")
def mixed_faults_live(tmp_path_factory) -> tuple[int, str, str, Path]:
    """tests/workers/mixed.py with every fault of test_spine.FAULTS against a live collector:
    (collector status, its stdout, its stderr, database). One job for test_spine (each fault
    one finding, the trace) and test_offline (the same findings from a dumped run)."""
    from .test_spine import FAULTS, _run

    return _run(tmp_path_factory.mktemp("mixed-faults"), ";".join(f[0] for f in FAULTS))


@pytest.fixture(scope="session")
def killed_rank_job(tmp_path_factory):
    """tests/workers/killed.py on 4 ranks of one node: rank 2 SIGKILLed right after its 7th
    all_reduce, its ring in a private ring folder, a collector with ``--hang-timeout 5
    --exit-when-done``: (torchrun's result, (collector status, stdout, stderr), database,
    ring folder). One job for test_dying (one rank_died) and test_relay (no record lost)."""
    from .. import harness

    tmp = tmp_path_factory.mktemp("killed")
    col = harness.start_collector(tmp, 4, "--hang-timeout", "5", "--exit-when-done")
    env = {"COMMCHECK_COLLECTOR": col.endpoint, "COMMCHECK_RUN_ID": "killed",
           "COMMCHECK_RING_DIR": str(tmp / "rings"), "KILL_AT": "7"}
    (job,) = harness.run_job(harness.WORKERS / "killed.py", env, nnodes=1, nproc=4)
    return job, col.wait(60), col.db, tmp / "rings"
