"""msprobe-compatible ``grad_probe`` configuration: parsing and validation.

The JSON layout is msprobe's (``task``, ``dump_path``, ``rank``, ``step`` at the top level,
``grad_level``/``param_list``/``bounds`` under ``grad_probe``), so existing config files work
unchanged. Validation is stricter than msprobe's: every bad field raises one
:class:`GradProbeConfigError` naming the field and the value, and unknown keys inside the
``grad_probe`` section are rejected because a typo there would otherwise silently fall back to a
default.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from commcheck.gradprobe.errors import GradProbeConfigError

Level = Literal["L0", "L1", "L2"]
LEVELS: tuple[str, ...] = ("L0", "L1", "L2")
TASK = "grad_probe"
INDEX_MAX = 1_000_000
BOUND_LIMIT = 2**63
DEFAULT_BOUNDS: tuple[float, ...] = (-1, 0, 1)
EXTENSION_KEYS = ("packed_direction", "max_pending_mib", "block_when_full", "native_kernel")
SECTION_KEYS = ("grad_level", "param_list", "bounds", *EXTENSION_KEYS)


@dataclass(frozen=True)
class IndexSelection:
    """A set of non-negative integers given as inclusive ranges; empty means "all".

    Kept as ranges rather than expanded so that ``"0-1000000"`` costs nothing.
    """

    ranges: tuple[tuple[int, int], ...] = ()

    def __contains__(self, index: object) -> bool:
        if not self.ranges:
            return True
        return isinstance(index, int) and any(lo <= index <= hi for lo, hi in self.ranges)


@dataclass(frozen=True)
class GradProbeConfig:
    """Validated settings of one gradient probe."""

    dump_path: str
    level: Level = "L1"
    rank: IndexSelection = field(default_factory=IndexSelection)
    step: IndexSelection = field(default_factory=IndexSelection)
    param_list: tuple[str, ...] = ()
    bounds: tuple[float, ...] = DEFAULT_BOUNDS
    packed_direction: bool = False
    max_pending_mib: int = 512
    block_when_full: bool = False
    native_kernel: bool = True

    @property
    def has_direction(self) -> bool:
        return self.level != "L0"


def parse_index_selection(name: str, value: Any) -> IndexSelection:
    """Parse msprobe's ``rank``/``step`` lists: ints and ``"a-b"`` inclusive ranges."""
    if value is None:
        return IndexSelection()
    if not isinstance(value, list):
        raise GradProbeConfigError(name, value, "must be a list of integers or 'a-b' ranges")
    ranges: list[tuple[int, int]] = []
    for item in value:
        ranges.append(_parse_index_item(name, item))
    return IndexSelection(tuple(sorted(set(ranges))))


def _parse_index_item(name: str, item: Any) -> tuple[int, int]:
    if isinstance(item, int) and not isinstance(item, bool):
        _check_index(name, item, item)
        return item, item
    if isinstance(item, str):
        parts = item.split("-")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise GradProbeConfigError(name, item, "a string entry must be a range like '4-6'")
        lo, hi = int(parts[0]), int(parts[1])
        _check_index(name, item, lo, hi)
        if lo > hi:
            raise GradProbeConfigError(name, item, f"range start {lo} is greater than end {hi}")
        return lo, hi
    raise GradProbeConfigError(name, item, "entries must be integers or 'a-b' range strings")


def _check_index(name: str, item: Any, *values: int) -> None:
    if any(not 0 <= v <= INDEX_MAX for v in values):
        raise GradProbeConfigError(name, item, f"must lie within [0, {INDEX_MAX}]")


def parse_level(value: Any) -> Level:
    if value not in LEVELS:
        raise GradProbeConfigError("grad_level", value, f"must be one of {', '.join(LEVELS)}")
    return value


def parse_param_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise GradProbeConfigError("param_list", value, "must be a list of parameter names")
    for item in value:
        if not isinstance(item, str) or not item:
            raise GradProbeConfigError("param_list", item, "entries must be non-empty strings")
    return tuple(dict.fromkeys(value))


def parse_bounds(value: Any) -> tuple[float, ...]:
    """Bounds split values into right-closed intervals; they must be finite and ascending."""
    if not isinstance(value, list | tuple):
        raise GradProbeConfigError("bounds", value, "must be a list of numbers")
    if not value:
        raise GradProbeConfigError("bounds", value, "must hold at least one number")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float):
            raise GradProbeConfigError("bounds", item, "entries must be numbers")
        if not math.isfinite(item) or not -BOUND_LIMIT <= item < BOUND_LIMIT:
            raise GradProbeConfigError("bounds", item, "entries must be finite and within int64")
    for prev, cur in zip(value, value[1:], strict=False):
        if not prev < cur:
            raise GradProbeConfigError(
                "bounds", list(value), f"must be strictly ascending ({prev} is not < {cur})"
            )
    return tuple(value)


def _parse_dump_path(value: Any) -> str:
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise GradProbeConfigError("dump_path", value, "must be a non-empty path string")
    return os.fspath(value)


def _parse_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise GradProbeConfigError(name, value, "must be true or false")
    return value


def _parse_pending(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GradProbeConfigError("max_pending_mib", value, "must be a positive integer (MiB)")
    return value


def build_config(
    dump_path: Any,
    level: Any = "L1",
    rank: Any = None,
    step: Any = None,
    param_list: Any = None,
    bounds: Any = DEFAULT_BOUNDS,
    packed_direction: Any = False,
    max_pending_mib: Any = 512,
    block_when_full: Any = False,
    native_kernel: Any = True,
) -> GradProbeConfig:
    """Validate keyword settings (the plain-Python API) into a :class:`GradProbeConfig`."""
    return GradProbeConfig(
        dump_path=_parse_dump_path(dump_path),
        level=parse_level(level),
        rank=parse_index_selection("rank", _as_list(rank)),
        step=parse_index_selection("step", _as_list(step)),
        param_list=parse_param_list(param_list),
        bounds=parse_bounds(bounds),
        packed_direction=_parse_bool("packed_direction", packed_direction),
        max_pending_mib=_parse_pending(max_pending_mib),
        block_when_full=_parse_bool("block_when_full", block_when_full),
        native_kernel=_parse_bool("native_kernel", native_kernel),
    )


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | range) else value


def parse_config(data: Mapping[str, Any]) -> GradProbeConfig:
    """Validate a decoded msprobe config dictionary."""
    if not isinstance(data, Mapping):
        raise GradProbeConfigError("config", data, "must be a JSON object")
    task = data.get("task", TASK)
    if task != TASK:
        raise GradProbeConfigError("task", task, f"must be {TASK!r}")
    if "dump_path" not in data:
        raise GradProbeConfigError("dump_path", None, "is required")
    section = data.get(TASK, {})
    if not isinstance(section, Mapping):
        raise GradProbeConfigError(TASK, section, "must be a JSON object")
    _reject_unknown(section.keys())
    return build_config(
        dump_path=data["dump_path"],
        level=section.get("grad_level", "L1"),
        rank=data.get("rank"),
        step=data.get("step"),
        param_list=section.get("param_list"),
        bounds=section.get("bounds", list(DEFAULT_BOUNDS)),
        packed_direction=section.get("packed_direction", False),
        max_pending_mib=section.get("max_pending_mib", 512),
        block_when_full=section.get("block_when_full", False),
        native_kernel=section.get("native_kernel", True),
    )


def _reject_unknown(keys: Iterable[str]) -> None:
    for key in keys:
        if key not in SECTION_KEYS:
            raise GradProbeConfigError(
                f"{TASK}.{key}", key, f"unknown key; expected one of {', '.join(SECTION_KEYS)}"
            )


def load_config(path: str | os.PathLike[str]) -> GradProbeConfig:
    """Read and validate an msprobe ``config.json``."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise GradProbeConfigError("config_path", os.fspath(path), "file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise GradProbeConfigError("config_path", os.fspath(path), f"unreadable: {exc}") from None
    return parse_config(data)
