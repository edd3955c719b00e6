"""GradComparator on hand-made dumps written exactly as msprobe 8.3.3 writes them.

The fixture writer below is independent of commcheck's writer: it formats the CSV the way
msprobe's ``write_csv`` does (UTF-8 BOM, ``\\r\\n``, minimal quoting, CRC32 "MD5", float reprs,
``str(list(shape))``) and saves directions with ``np.save``, so this checks compatibility even
where msprobe itself is not installed.
"""

from __future__ import annotations

import csv
import os
import zlib

import matplotlib.image
import numpy as np
import pytest
import torch

from commcheck.gradprobe import (
    DumpFormatError,
    DumpNotFoundError,
    GradComparator,
    GradProbe,
    NoCommonDataError,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHAPES = {"layer.weight": (5, 4), "layer.bias": (5,)}  # torch.nn.Linear(4, 5)


def msprobe_csv(path, level: str, grads: dict[str, np.ndarray]) -> None:
    """A grad_summary CSV byte-for-byte as msprobe 8.3.3 writes it (L0 or L1)."""
    header = ["param_name", "MD5", "max", "min", "norm", "shape"]
    if level == "L1":
        header.remove("MD5")
    lines = [",".join(header)]
    for name, g in grads.items():
        cells = [name]
        if level == "L0":
            cells.append(f"{zlib.crc32(g.astype(np.float32).tobytes()):08x}")
        stats = [g.max(), g.min(), np.linalg.norm(g.astype(np.float64))]
        cells += [repr(float(np.float32(v))) for v in stats]
        shape = str(list(g.shape))
        cells.append(f'"{shape}"' if "," in shape else shape)
        lines.append(",".join(cells))
    with open(path, "wb") as fh:
        fh.write(("\r\n".join(lines) + "\r\n").encode("utf-8-sig"))


def write_run(root, rank: int, directions: dict[int, dict[str, np.ndarray]], level="L1") -> str:
    rank_dir = os.path.join(root, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    for step, arrays in directions.items():
        grads = {
            n: np.where(a, 1.0, -1.0).astype(np.float32) * (step + 1) for n, a in arrays.items()
        }
        msprobe_csv(os.path.join(rank_dir, f"grad_summary_{step}.csv"), level, grads)
        if level != "L0":
            os.makedirs(os.path.join(rank_dir, f"step{step}"), exist_ok=True)
            for name, a in arrays.items():
                np.save(os.path.join(rank_dir, f"step{step}", f"{name}.npy"), a)
    return rank_dir


def read(path) -> list[list[str]]:
    with open(path, encoding="utf-8-sig", newline="") as fh:
        return list(csv.reader(fh))


def hand_made(seed: int, flips: dict[int, dict[str, int]] | None = None):
    """Run A = random directions; run B = A with a chosen number of elements flipped."""
    rng = np.random.default_rng(seed)
    a, b = {}, {}
    for step in range(3):
        a[step], b[step] = {}, {}
        for name, shape in SHAPES.items():
            arr = rng.random(shape) > 0.5
            other = arr.copy().reshape(-1)
            n = (flips or {}).get(step, {}).get(name, 0)
            other[:n] = ~other[:n]
            a[step][name], b[step][name] = arr, other.reshape(shape)
    return a, b


FLIPS = {0: {}, 1: {"layer.weight": 2}, 2: {"layer.weight": 20, "layer.bias": 1}}


@pytest.mark.timeout(30)
def test_similarity_formula_csv_and_extras(tmp_path) -> None:
    a, b = hand_made(0, FLIPS)
    write_run(tmp_path / "A", 0, a)
    write_run(tmp_path / "B", 0, b)
    results = GradComparator.compare_distributed(
        str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "out")
    )
    assert list(results) == [0]
    out = tmp_path / "out" / "rank0"
    raw = (out / "similarities.csv").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfstep,0,1,2\r\n")
    rows = read(out / "similarities.csv")
    assert rows[0] == ["step", "0", "1", "2"]
    assert [r[0] for r in rows[1:]] == ["layer.weight", "layer.bias", "summary"]
    weight = [1.0, 18 / 20, 0.0]
    bias = [1.0, 1.0, 4 / 5]
    summary = [1.0, 23 / 25, 4 / 25]
    assert [float(v) for v in rows[1][1:]] == weight
    assert [float(v) for v in rows[2][1:]] == bias
    assert [float(v) for v in rows[3][1:]] == summary
    below = {r[0]: r[1] for r in read(out / "below_threshold.csv")[1:]}
    assert below == {"layer.weight": "1", "layer.bias": "2", "summary": "1"}
    diffs = read(out / "stat_diffs.csv")
    assert diffs[0][:5] == ["step", "param_name", "max_a", "max_b", "max_rel_diff"]
    step0 = [r for r in diffs[1:] if r[0] == "0"]
    assert len(step0) == 2 and all(float(r[4]) == 0.0 for r in step0)  # FLIPS[0] is empty


@pytest.mark.timeout(30)
def test_plots_are_valid_pngs(tmp_path) -> None:
    a, b = hand_made(1, FLIPS)
    write_run(tmp_path / "A", 0, a)
    write_run(tmp_path / "B", 0, b)
    GradComparator.compare(
        str(tmp_path / "A" / "rank0"), str(tmp_path / "B" / "rank0"), str(tmp_path / "o")
    )
    pictures = tmp_path / "o" / "similarities_picture"
    expected = {f"{n}_similarities.png" for n in [*SHAPES, "summary"]}
    assert set(os.listdir(pictures)) == expected
    for name in expected:
        assert (pictures / name).read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(pictures / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.timeout(30)
def test_l0_dumps_compare_on_statistics(tmp_path) -> None:
    a, b = hand_made(2)
    write_run(tmp_path / "A", 0, a, level="L0")
    write_run(tmp_path / "B", 0, b, level="L0")
    b_csv = tmp_path / "B" / "rank0" / "grad_summary_2.csv"
    text = b_csv.read_bytes().split(b"\r\n")
    cells = text[2].split(b",")
    cells[4] = b"6.5"  # norm of layer.bias at step 2 in run B
    text[2] = b",".join(cells)
    b_csv.write_bytes(b"\r\n".join(text))
    result = GradComparator.compare(
        str(tmp_path / "A" / "rank0"), str(tmp_path / "B" / "rank0"), str(tmp_path / "o")
    )
    assert result.mode == "statistics" and result.steps == [0, 1, 2]
    assert not (tmp_path / "o" / "similarities.csv").exists()
    rows = read(tmp_path / "o" / "stat_diffs.csv")
    changed = [r for r in rows[1:] if r[0] == "2" and r[1] == "layer.bias"][0]
    norm_a = float(changed[8])
    assert float(changed[9]) == 6.5
    assert float(changed[10]) == pytest.approx(abs(norm_a - 6.5) / max(norm_a, 6.5))
    assert changed[11] == "True"  # same CRC32 "MD5" algorithm on both sides, same bytes


@pytest.mark.timeout(30)
def test_our_dump_against_msprobe_fixture(tmp_path) -> None:
    """Our L1 dump of gradients equal to the fixture's directions compares at similarity 1."""
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(4, 5)
    a, _ = hand_made(3)
    probe = GradProbe(model, level="L1", dump_path=str(tmp_path / "ours"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        for name, p in model.named_parameters():
            p.grad = torch.from_numpy(np.where(a[step][name], 1.0, -1.0)).float()
        opt.step()
    probe.stop()
    write_run(tmp_path / "theirs", 0, a)
    result = GradComparator.compare_distributed(
        str(tmp_path / "ours"), str(tmp_path / "theirs"), str(tmp_path / "o")
    )[0]
    assert result.similarities["summary"] == [1.0, 1.0, 1.0]
    assert len(result.stat_diffs) == 3 * 2  # steps × parameters
    assert all(d.hash_equal is None for d in result.stat_diffs)


@pytest.mark.timeout(30)
def test_bad_inputs_raise_one_clear_error(tmp_path) -> None:
    a, b = hand_made(4)
    write_run(tmp_path / "A", 0, a)
    write_run(tmp_path / "B", 1, b)
    with pytest.raises(DumpNotFoundError, match="missing"):
        GradComparator.compare_distributed(str(tmp_path / "missing"), str(tmp_path / "A"), "o")
    with pytest.raises(NoCommonDataError, match="rank"):
        GradComparator.compare_distributed(str(tmp_path / "A"), str(tmp_path / "B"), "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCommonDataError, match="no step"):
        GradComparator.compare(str(tmp_path / "A" / "rank0"), str(tmp_path / "empty"), "o")
    write_run(tmp_path / "C", 0, b)
    (tmp_path / "C" / "rank0" / "grad_summary_1.csv").write_text("param_name,max\nx,1\n")
    with pytest.raises(DumpFormatError, match="grad_summary_1.csv"):
        GradComparator.compare_distributed(str(tmp_path / "A"), str(tmp_path / "C"), "o")
    write_run(tmp_path / "D", 0, b)
    np.save(tmp_path / "D" / "rank0" / "step2" / "layer.bias.npy", np.zeros(6, bool))
    with pytest.raises(DumpFormatError, match="shapes differ"):
        GradComparator.compare_distributed(str(tmp_path / "A"), str(tmp_path / "D"), "o")
    write_run(tmp_path / "E", 0, b)
    (tmp_path / "E" / "rank0" / "step0" / "layer.bias.npy").write_bytes(b"garbage")
    with pytest.raises(DumpFormatError, match="corrupt"):
        GradComparator.compare_distributed(str(tmp_path / "A"), str(tmp_path / "E"), "o")


@pytest.mark.timeout(60)
def test_real_msprobe_compare_reads_our_dump(tmp_path) -> None:
    """Runs only where msprobe is importable (it needs pandas and tqdm, not Ascend)."""
    np_unicode = getattr(np, "unicode_", None)
    if np_unicode is None:
        np.unicode_ = np.str_  # msprobe 8.3.3 still references the NumPy 1 alias
    try:
        grad_compare = pytest.importorskip("msprobe.core.grad_probe.grad_compare")
    finally:
        if np_unicode is None:
            del np.unicode_
    a, b = hand_made(5, FLIPS)
    write_run(tmp_path / "theirs", 0, a)
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(4, 5)
    probe = GradProbe(model, level="L2", dump_path=str(tmp_path / "ours"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        for name, p in model.named_parameters():
            p.grad = torch.from_numpy(np.where(b[step][name], 0.5, -0.5)).float()
        opt.step()
    probe.stop()
    grad_compare.GradComparator.compare_distributed(
        str(tmp_path / "theirs"), str(tmp_path / "ours"), str(tmp_path / "msprobe_out")
    )
    GradComparator.compare_distributed(
        str(tmp_path / "theirs"), str(tmp_path / "ours"), str(tmp_path / "our_out")
    )
    theirs = (tmp_path / "msprobe_out" / "rank0" / "similarities.csv").read_bytes()
    ours = (tmp_path / "our_out" / "rank0" / "similarities.csv").read_bytes()
    assert theirs == ours
