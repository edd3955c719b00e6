"""Typed values the engine works on: one rank's observation of a call. Findings, what the
engine makes of them, are the report's contract and live in ``findings.py``."""

from __future__ import annotations

from typing import NamedTuple

from .findings import Finding  # re-exported for the engine modules that import it from here

__all__ = ["Finding", "Key", "Meta", "Obs", "group_label"]

Key = tuple[str, str, tuple[int, ...], int]  # run, group name, group ranks, seq


class Obs(NamedTuple):
    """What one rank reported for one collective."""

    rank: int
    host: str
    op: str
    dtype: str
    redop: str
    root: int
    algo: str
    callsite: str
    flags: int
    numel_in: int
    numel_out: int
    step: int
    t_done: float
    in_hash: tuple[int, int]
    out_hash: tuple[int, int]
    in_sum: float
    in_absmax: float
    in_nan: int
    in_inf: int
    out_sum: float
    out_absmax: float
    out_nan: int
    out_inf: int
    chunks: tuple[tuple[int, int, int, int, float], ...]  # side, owner rank, h0, h1, sum


class Meta(NamedTuple):
    """What a rank said about a call when it entered it: enough to spot a desync or a hang."""

    rank: int
    host: str
    op: str
    dtype: str
    numel_in: int
    numel_out: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    redop: str
    root: int
    peer: int
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]
    callsite: str
    step: int
    t_enter: float


def group_label(name: str, ranks: tuple[int, ...]) -> str:
    if ranks == tuple(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{name}[{ranks[0]}-{ranks[-1]}]"
    return f"{name}[{','.join(map(str, ranks))}]"

