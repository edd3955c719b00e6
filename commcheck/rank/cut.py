"""Cutting one side of a call into the per-rank units that get fingerprinted.

A *unit* is a list of tensors hashed as one (a single tensor, or for coalesced ops one
tensor per coalesced buffer); a side is a list of units, one per chunk, each owned by the
global rank it was sent to or came from (``None``: an unchunked side).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..wire.ops import Split
from .groups import Group

Unit = list[torch.Tensor]


def tensors(x: object) -> list[torch.Tensor]:
    """Every tensor of an argument (a tensor, a list, or a list of lists), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors(item)]
    return []


def shape(x: object) -> tuple[int, ...]:
    """A tensor's shape; a list's length followed by its first element's shape."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, (list, tuple)) and x:
        return (len(x), *shape(x[0]))
    return ()


def _pieces(t: torch.Tensor, n: int, dim: int, sizes: Sequence[int] | None) -> list[Unit]:
    if sizes:
        return [[p] for p in t.split(list(sizes), dim=0)]
    if not t.numel():
        return [[t]]
    if dim == 0:
        return [[p] for p in t.reshape(-1).chunk(n)]
    return [[p] for p in t.chunk(n, dim=dim)]


def units(x: object, how: Split, n: int, dim: int = 0,
          sizes: Sequence[int] | None = None) -> list[Unit]:
    if how is Split.LIST:
        return [[t] for t in x]  # type: ignore[union-attr]
    if how is Split.FLAT:
        return _pieces(x, n, dim, sizes)  # type: ignore[arg-type]
    if how is Split.MANY:
        return [list(x)]  # type: ignore[call-overload]
    if how is Split.LISTS:
        return [list(lst) for lst in x]  # type: ignore[union-attr]
    return [[x]]  # type: ignore[list-item]


def owners(how: Split, group: Group, counterpart: int) -> list[int] | None:
    """Global rank owning each unit; ``counterpart`` is the root or the p2p peer."""
    if how in (Split.NONE, Split.MANY):
        return None
    return [counterpart] if how is Split.ROOT else group.members
