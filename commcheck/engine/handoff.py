"""What crosses between the engine's two paths: the fast path (``fastpath.py``) hands what
it cannot decide to the exact path (``core.py``) as these values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..wire import Batch
from .model import Meta, Obs

HUGE_SEQ = 1 << 62  # sequence numbers from here on are never fast (ring arithmetic)

# on_enter(rank, group name, group ranks, seq, meta, ticket): a member entered a key.
OnEnter = Callable[[int, str, tuple[int, ...], int, Meta, int], None]


@dataclass
class OpenKey:
    """One collective some members have not completed yet, as the exact path holds it."""

    entered: dict[int, Meta] = field(default_factory=dict)
    complete: dict[int, Obs] = field(default_factory=dict)
    desync_checked: bool = False
    desynced: bool = False
    hang_reported: bool = False
    born: int = 0  # ticket of the record that opened the key: hangs are reported in this order
    wid: int = -1  # the fast path's window, when it knows the group


class Rows:
    """One batch's records as Python values, for the per-record (exact) path."""

    def __init__(self, batch: Batch):
        env, rec = batch.env, batch.records
        self.env = env
        self.groups = [(name, tuple(ranks)) for name, ranks in env.groups]
        self.cols = {name: rec[name].tolist() for name in rec.dtype.names}
        self.chunks = batch.chunks.tolist()
        self.shapes = batch.shapes.tolist()
