"""Process-group identity and per-group sequence numbers (DESIGN.md rule 4).

Identity is (group name, sorted global ranks): names alone can be reused after a group is
destroyed. Every member calls a group's collectives in the same order, so a counter per
identity on each rank yields matching sequence numbers without any communication.

Point-to-point traffic gets a pseudo-group per directed pair (``p2p:SRC->DST``, ranks
sorted), so each direction has its own sequence: the n-th message from SRC to DST on the
sender is the n-th on the receiver. Different tags and process groups are separate
channels that may be matched out of order, so they get their own pairs.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch.distributed.distributed_c10d as c10d


@dataclass
class Group:
    name: str
    ranks: tuple[int, ...]  # sorted global ranks: the identity
    rank_in_group: int
    next_seq: int = 0
    global_to_group: dict[int, int] = field(default_factory=dict)

    @functools.cached_property
    def members(self) -> list[int]:
        """Global ranks in group-rank order: chunk j of a list/flat side belongs to members[j].
        (A group's mapping never changes once made; read for every chunked call.)"""
        return sorted(self.global_to_group, key=self.global_to_group.__getitem__)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def take_seq(self) -> int:
        s = self.next_seq
        self.next_seq += 1
        return s


class Groups:
    def __init__(self) -> None:
        self._by_pg: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._by_identity: dict[tuple[str, tuple[int, ...]], Group] = {}
        self._pairs: dict[tuple[int, int, str], Group] = {}

    def resolve(self, pg: object | None) -> Group | None:
        """The Group for ``pg`` (None: the default group); None if this rank is not in it."""
        if pg is None:
            pg = c10d._get_default_group()
        elif not isinstance(pg, c10d.ProcessGroup):  # GroupMember.NON_GROUP_MEMBER & co.
            return None
        g = self._by_pg.get(pg)
        if g is not None:
            return g
        mapping = c10d._world.pg_group_ranks.get(pg)
        if not mapping:
            return None
        me = c10d.get_rank()
        if me not in mapping:
            return None
        ranks = tuple(sorted(mapping))
        ident = (pg.group_name, ranks)
        g = self._by_identity.get(ident)
        if g is None:
            g = self._by_identity[ident] = Group(pg.group_name, ranks, mapping[me],
                                                 global_to_group=dict(mapping))
        self._by_pg[pg] = g
        return g

    def pair(self, src: int, dst: int, channel: str = "") -> Group:
        """The pseudo-group of messages from ``src`` to ``dst`` (global ranks)."""
        key = (src, dst, channel)
        g = self._pairs.get(key)
        if g is None:
            me = c10d.get_rank()
            mapping = {src: 0, dst: 1}
            g = self._pairs[key] = Group(f"p2p:{src}->{dst}{channel}", tuple(sorted(mapping)),
                                         mapping[me], global_to_group=mapping)
        return g
