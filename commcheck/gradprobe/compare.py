"""Compare two gradient dumps step by step (msprobe ``GradComparator`` semantics, plus extras).

Direction mode (L1/L2 dumps): for every ``step{N}`` directory present in both runs,
``similarity = count(dir_a == dir_b) / numel`` per parameter and an element-weighted ``summary``;
``similarities.csv`` and ``similarities_picture/*.png`` match msprobe's output. Statistics mode
(L0 dumps, which carry no directions): the CSVs are compared instead of failing.

Extras, in separate files so msprobe consumers are unaffected: ``stat_diffs.csv`` (relative
differences of max/min/norm, ``|a-b| / max(|a|, |b|)``, symmetric because either run may be the
baseline) and ``below_threshold.csv`` (first step each parameter's similarity drops below the
threshold).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from commcheck.gradprobe import layout
from commcheck.gradprobe.errors import DumpFormatError, DumpNotFoundError, NoCommonDataError

SUMMARY = "summary"
DEFAULT_THRESHOLD = 0.97
REQUIRED_COLUMNS = ("param_name", *layout.STAT_COLUMNS, "shape")


@dataclass(frozen=True)
class SummaryRow:
    name: str
    stats: tuple[float, float, float]
    shape: tuple[int, ...]
    digest: str | None


@dataclass(frozen=True)
class SummaryTable:
    """One parsed ``grad_summary_{step}.csv``."""

    path: str
    rows: dict[str, SummaryRow]


@dataclass(frozen=True)
class StatDiff:
    step: int
    name: str
    a: tuple[float, float, float]
    b: tuple[float, float, float]
    hash_equal: bool | None

    @property
    def rel(self) -> tuple[float, float, float]:
        return tuple(relative_difference(x, y) for x, y in zip(self.a, self.b, strict=True))


@dataclass
class RankComparison:
    """Result for one rank directory pair; also what the terminal summary renders."""

    label: str
    output_dir: str
    mode: Literal["direction", "statistics"]
    steps: list[int]
    similarities: dict[str, list[float]] = field(default_factory=dict)
    stat_diffs: list[StatDiff] = field(default_factory=list)
    first_below: dict[str, int | None] = field(default_factory=dict)
    threshold: float = DEFAULT_THRESHOLD


def relative_difference(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.nan
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if math.isfinite(scale) else math.inf


def read_summary(path: str) -> SummaryTable:
    """Parse a summary CSV written by us or by msprobe; any defect is a DumpFormatError."""
    try:
        lines = layout.read_csv(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise DumpFormatError(f"{path}: unreadable: {exc}") from None
    if not lines:
        raise DumpFormatError(f"{path}: empty file, expected a header line")
    header = lines[0]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if header[:1] != ["param_name"] or missing:
        raise DumpFormatError(f"{path}: header {header} lacks columns {missing or ['param_name']}")
    index = {
        name: header.index(name)
        for name in (*REQUIRED_COLUMNS, layout.HASH_COLUMN)
        if name in header
    }
    rows: dict[str, SummaryRow] = {}
    for number, cells in enumerate(lines[1:], start=2):
        if len(cells) != len(header):
            raise DumpFormatError(
                f"{path}: line {number} has {len(cells)} cells, header has {len(header)}"
            )
        try:
            stats = tuple(float(cells[index[c]]) for c in layout.STAT_COLUMNS)
            shape = layout.parse_shape(cells[index["shape"]])
        except ValueError as exc:
            raise DumpFormatError(f"{path}: line {number}: {exc}") from None
        digest = cells[index[layout.HASH_COLUMN]] if layout.HASH_COLUMN in index else None
        rows[cells[0]] = SummaryRow(cells[0], stats, shape, digest)  # type: ignore[arg-type]
    return SummaryTable(path, rows)


def _indices(path: str, pattern: str) -> set[int]:
    regex = re.compile(pattern)
    found = set()
    for entry in os.listdir(path):
        match = regex.fullmatch(entry)
        if match:
            found.add(int(match.group(1)))
    return found


def _require_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise DumpNotFoundError(f"dump directory not found: {path}")


class GradComparator:
    """msprobe-compatible entry points: ``compare`` (one rank) and ``compare_distributed``."""

    @classmethod
    def compare_distributed(
        cls, path1: str, path2: str, output_dir: str, threshold: float = DEFAULT_THRESHOLD
    ) -> dict[int, RankComparison]:
        _require_dir(path1)
        _require_dir(path2)
        ranks = sorted(
            r
            for r in _indices(path1, r"rank(\d+)")
            if os.path.isdir(layout.rank_dir(path2, r)) and os.path.isdir(layout.rank_dir(path1, r))
        )
        if not ranks:
            raise NoCommonDataError(f"no rank<N> directory is present in both {path1} and {path2}")
        return {
            rank: cls.compare(
                layout.rank_dir(path1, rank),
                layout.rank_dir(path2, rank),
                layout.rank_dir(output_dir, rank),
                threshold,
            )
            for rank in ranks
        }

    @classmethod
    def compare(
        cls, path1: str, path2: str, output_dir: str, threshold: float = DEFAULT_THRESHOLD
    ) -> RankComparison:
        _require_dir(path1)
        _require_dir(path2)
        step_dirs = sorted(
            s
            for s in _indices(path1, r"step(\d+)") & _indices(path2, r"step(\d+)")
            if os.path.isdir(layout.step_dir(path1, s)) and os.path.isdir(layout.step_dir(path2, s))
        )
        csv_pattern = re.escape(layout.SUMMARY_PREFIX) + r"(\d+)\.csv"
        csv_steps = sorted(_indices(path1, csv_pattern) & _indices(path2, csv_pattern))
        if not step_dirs and not csv_steps:
            raise NoCommonDataError(
                f"no step is present in both {path1} and {path2} "
                "(looked for step<N>/ directories and grad_summary_<N>.csv files)"
            )
        tables = {
            s: (
                read_summary(layout.summary_csv_path(path1, s)),
                read_summary(layout.summary_csv_path(path2, s)),
            )
            for s in csv_steps
        }
        mode: Literal["direction", "statistics"] = "direction" if step_dirs else "statistics"
        result = RankComparison(
            label=os.path.basename(os.path.normpath(path1)),
            output_dir=output_dir,
            mode=mode,
            steps=step_dirs or csv_steps,
            stat_diffs=_stat_diffs(tables),
            threshold=threshold,
        )
        if step_dirs:
            order = _param_order(path1, step_dirs, tables)
            result.similarities = _similarities(path1, path2, step_dirs, order, tables)
            result.first_below = _first_below(result.similarities, step_dirs, threshold)
        os.makedirs(output_dir, exist_ok=True)
        _write_outputs(result)
        return result


def _param_order(path: str, steps: list[int], tables: dict) -> list[str]:
    """msprobe orders parameters as the summary CSV lists them; without one, by file name."""
    if tables:
        return list(tables[min(tables)][0].rows)
    step_path = layout.step_dir(path, steps[0])
    names = {
        f[: -len(suffix)]
        for f in os.listdir(step_path)
        for suffix in (layout.DIRECTION_SUFFIX, layout.PACKED_SUFFIX)
        if f.endswith(suffix)
    }
    if not names:
        raise DumpFormatError(f"{step_path}: no direction files (*.npy) found")
    return sorted(names)


def _shape_of(tables: dict, step: int, name: str) -> tuple[int, ...] | None:
    pair = tables.get(step)
    if pair is None or name not in pair[0].rows:
        return None
    return pair[0].rows[name].shape


def _load(step_path: str, name: str, shape: tuple[int, ...] | None) -> np.ndarray:
    try:
        array = layout.load_direction(step_path, name, shape)
    except FileNotFoundError:
        raise DumpFormatError(
            f"{layout.direction_path(step_path, name)}: missing direction file"
        ) from None
    except (ValueError, OSError, EOFError) as exc:
        raise DumpFormatError(f"{layout.direction_path(step_path, name)}: corrupt: {exc}") from None
    if array.dtype != np.bool_:
        raise DumpFormatError(
            f"{layout.direction_path(step_path, name)}: dtype {array.dtype}, expected bool"
        )
    return array


def _similarities(
    path1: str, path2: str, steps: list[int], order: list[str], tables: dict
) -> dict[str, list[float]]:
    sims: dict[str, list[float]] = {name: [] for name in order}
    sims[SUMMARY] = []
    for step in steps:
        same_total = count_total = 0
        for name in order:
            shape = _shape_of(tables, step, name)
            a = _load(layout.step_dir(path1, step), name, shape)
            b = _load(layout.step_dir(path2, step), name, shape)
            if a.shape != b.shape:
                raise DumpFormatError(
                    f"step {step}, {name}: direction shapes differ: {a.shape} vs {b.shape}"
                )
            same = int(np.count_nonzero(a == b))
            same_total += same
            count_total += a.size
            sims[name].append(same / a.size if a.size else 0)
        sims[SUMMARY].append(same_total / count_total if count_total else 0)
    return sims


def _first_below(
    sims: dict[str, list[float]], steps: list[int], threshold: float
) -> dict[str, int | None]:
    return {
        name: next((s for s, v in zip(steps, values, strict=True) if v < threshold), None)
        for name, values in sims.items()
    }


def _stat_diffs(tables: dict) -> list[StatDiff]:
    diffs = []
    for step, (ta, tb) in sorted(tables.items()):
        for name, ra in ta.rows.items():
            rb = tb.rows.get(name)
            if rb is None:
                continue
            comparable = ra.digest is not None and rb.digest is not None
            same_algo = comparable and len(ra.digest) == len(rb.digest)  # type: ignore[arg-type]
            hash_equal = (ra.digest == rb.digest) if same_algo else None
            diffs.append(StatDiff(step, name, ra.stats, rb.stats, hash_equal))
    return diffs


def _write_outputs(result: RankComparison) -> None:
    from commcheck.gradprobe.plots import save_line_plot  # matplotlib: not for every CLI start

    out = result.output_dir
    if result.similarities:
        rows: list[list[object]] = [["step", *[str(s) for s in result.steps]]]
        rows += [[name, *values] for name, values in result.similarities.items()]
        layout.write_csv(os.path.join(out, "similarities.csv"), rows)
        pictures = os.path.join(out, "similarities_picture")
        os.makedirs(pictures, exist_ok=True)
        for name, values in result.similarities.items():
            save_line_plot(
                os.path.join(pictures, f"{name}_similarities.png"),
                result.steps,
                values,
                f"{name}_similarities",
                threshold=result.threshold,
            )
        below = [["param_name", "first_step_below", "similarity", "threshold"]]
        for name, step in result.first_below.items():
            value = "" if step is None else result.similarities[name][result.steps.index(step)]
            below.append([name, "" if step is None else step, value, result.threshold])
        layout.write_csv(os.path.join(out, "below_threshold.csv"), below)
    header = ["step", "param_name"]
    for col in layout.STAT_COLUMNS:
        header += [f"{col}_a", f"{col}_b", f"{col}_rel_diff"]
    header.append("hash_equal")
    rows = [header]
    for d in result.stat_diffs:
        row: list[object] = [d.step, d.name]
        for a, b, rel in zip(d.a, d.b, d.rel, strict=True):
            row += [a, b, rel]
        row.append("" if d.hash_equal is None else d.hash_equal)
        rows.append(row)
    layout.write_csv(os.path.join(out, "stat_diffs.csv"), rows)
