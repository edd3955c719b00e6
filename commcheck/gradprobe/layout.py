"""On-disk layout and byte formats shared by the writer, the comparator and the tests.

Everything here reproduces msprobe 8.3.3 (``msprobe/pytorch/grad_probe`` and
``msprobe/core/common/file_utils.write_csv``) byte for byte: CSVs are written with a UTF-8 BOM
(``utf-8-sig``), ``\\r\\n`` line ends and minimal quoting; numbers are Python ``repr`` of the
float32 statistic widened to float64; shapes are ``str(list(shape))``; interval headers are
f-strings of the config's bound values (``-1`` stays ``-1``, ``0.5`` stays ``0.5``).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Sequence

import numpy as np

SUMMARY_PREFIX = "grad_summary_"
DIRECTION_SUFFIX = ".npy"
PACKED_SUFFIX = ".bits"
CSV_ENCODING = "utf-8-sig"
HASH_COLUMN = "MD5"
ZERO_COLUMN = "=0"
STAT_COLUMNS = ("max", "min", "norm")


def rank_dir(dump_path: str, rank: int) -> str:
    return os.path.join(dump_path, f"rank{rank}")


def summary_csv_path(rank_path: str, step: int) -> str:
    return os.path.join(rank_path, f"{SUMMARY_PREFIX}{step}.csv")


def step_dir(rank_path: str, step: int) -> str:
    return os.path.join(rank_path, f"step{step}")


def direction_path(step_path: str, param_name: str) -> str:
    return os.path.join(step_path, f"{param_name}{DIRECTION_SUFFIX}")


def packed_path(step_path: str, param_name: str) -> str:
    """Packed bits live beside the ``.npy`` under a suffix msprobe's compare ignores."""
    return os.path.join(step_path, f"{param_name}{PACKED_SUFFIX}")


def interval_headers(bounds: Sequence[float]) -> list[str]:
    headers = [f"(-inf, {bounds[0]}]"]
    headers += [f"({lo}, {hi}]" for lo, hi in zip(bounds, bounds[1:], strict=False)]
    headers.append(f"({bounds[-1]}, inf)")
    return headers


def csv_header(level: str, bounds: Sequence[float]) -> list[str]:
    """Column names of ``grad_summary_{step}.csv`` for a level, as msprobe writes them."""
    if level == "L0":
        return ["param_name", HASH_COLUMN, *STAT_COLUMNS, "shape"]
    if level == "L1":
        return ["param_name", *STAT_COLUMNS, "shape"]
    return ["param_name", *interval_headers(bounds), ZERO_COLUMN, *STAT_COLUMNS, "shape"]


def format_shape(shape: Sequence[int]) -> str:
    return str([int(d) for d in shape])


def parse_shape(text: str) -> tuple[int, ...]:
    inner = text.strip()
    if not (inner.startswith("[") and inner.endswith("]")):
        raise ValueError(f"shape {text!r} is not a list like [3, 4]")
    body = inner[1:-1].strip()
    return tuple(int(part) for part in body.split(",")) if body else ()


def encode_csv(rows: Iterable[Sequence[object]]) -> bytes:
    """Serialise rows exactly as msprobe's ``write_csv`` does (BOM, CRLF, minimal quoting)."""
    buf = io.StringIO(newline="")
    csv.writer(buf).writerows(rows)
    return buf.getvalue().encode(CSV_ENCODING)


def write_csv(path: str, rows: Iterable[Sequence[object]]) -> None:
    with open(path, "wb") as fh:
        fh.write(encode_csv(rows))


def read_csv(path: str) -> list[list[str]]:
    with open(path, encoding=CSV_ENCODING, newline="") as fh:
        return list(csv.reader(fh))


def npy_header(shape: Sequence[int], dtype: np.dtype = np.dtype(bool)) -> bytes:
    """The exact header ``np.save`` writes for a C-ordered array (format 1.0, 64-byte aligned)."""
    buf = io.BytesIO()
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": tuple(int(d) for d in shape),
    }
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def load_direction(step_path: str, param_name: str, shape: Sequence[int] | None) -> np.ndarray:
    """Load a direction array from the ``.npy``, falling back to the packed ``.bits`` file."""
    path = direction_path(step_path, param_name)
    if os.path.exists(path):
        return np.load(path, mmap_mode="r", allow_pickle=False)
    packed = packed_path(step_path, param_name)
    if not os.path.exists(packed) or shape is None:
        raise FileNotFoundError(path)
    bits = np.load(packed, allow_pickle=False)
    count = int(np.prod(shape, dtype=np.int64))
    return np.unpackbits(bits, count=count).view(bool).reshape(tuple(shape))
