"""``commcheck grad compare``: success output and one-line errors with exit status 2."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from commcheck.gradprobe.cli import grad_app
from tests.unit.test_gradprobe_compare import FLIPS, hand_made, write_run

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(grad_app, ["compare", *args])


@pytest.mark.timeout(30)
def test_compare_writes_outputs_and_summary(tmp_path) -> None:
    a, b = hand_made(7, FLIPS)
    write_run(tmp_path / "A", 0, a)
    write_run(tmp_path / "B", 0, b)
    result = invoke(
        str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "o"), "--threshold", "0.95"
    )
    assert result.exit_code == 0, result.output
    assert "layer.weight" in result.stdout and "first step < 0.95" in result.stdout
    assert (tmp_path / "o" / "rank0" / "similarities.csv").exists()
    single = invoke(
        str(tmp_path / "A" / "rank0"), str(tmp_path / "B" / "rank0"), str(tmp_path / "s")
    )
    assert single.exit_code == 0 and (tmp_path / "s" / "similarities.csv").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["missing", "no-ranks", "corrupt", "threshold"])
def test_errors_are_one_line_exit_2(tmp_path, case: str) -> None:
    a, b = hand_made(8)
    write_run(tmp_path / "A", 0, a)
    write_run(tmp_path / "B", 1 if case == "no-ranks" else 0, b)
    extra: list[str] = []
    run_a = str(tmp_path / ("nowhere" if case == "missing" else "A"))
    if case == "corrupt":
        (tmp_path / "B" / "rank0" / "grad_summary_0.csv").write_bytes(b"\xff\xfe\x00garbage")
    if case == "threshold":
        extra = ["--threshold", "1.5"]
    result = invoke(run_a, str(tmp_path / "B"), str(tmp_path / "o"), *extra)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commcheck grad compare: error: ")
    assert "Traceback" not in result.output
