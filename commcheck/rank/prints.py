"""Fingerprints of one side (input or output) of a call, possibly cut into per-rank chunks.

CPU parts are computed at once; device parts are :class:`DevicePrint` objects that the
sender thread resolves once their event fired. Chunked sides combine their chunk hashes
(xxh3-128 over the chunk digests in rank order), so a whole-side hash costs no second pass
and stays position-aware.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..wire import Chunk, combine_hashes
from .fingerprint import ALGO_XXH3, ZERO_SUMMARY, DevicePrint, Summary, algo_for, fingerprint_cpu


def combine_summaries(parts: list[Summary]) -> Summary:
    if not parts:
        return ZERO_SUMMARY
    return (
        sum(p[0] for p in parts),
        max(p[1] for p in parts),
        sum(p[2] for p in parts),
        sum(p[3] for p in parts),
    )


def _one(hashes: list[tuple[int, int]]) -> tuple[int, int]:
    """The hash of a unit: its tensor's own, or the combination of its tensors'."""
    if not hashes:
        return (0, 0)
    return hashes[0] if len(hashes) == 1 else combine_hashes(hashes)


@dataclass
class Part:
    owner: int  # global rank the chunk belongs to; -1 for an unchunked side
    hash: tuple[int, int] = (0, 0)
    summary: Summary = ZERO_SUMMARY
    pending: list[DevicePrint] | None = None


@dataclass
class SidePrint:
    side: int
    algo: str
    parts: list[Part]

    hashed: bool = True
    summarized: bool = True

    @classmethod
    def take(cls, side: int, units: list[list[torch.Tensor]], owners: list[int] | None, *,
             hash: bool, summary: bool) -> SidePrint:
        """Fingerprint now (CPU) or enqueue on the device; one Part per unit.

        A unit of several tensors (coalesced ops) hashes as the combination of theirs, so
        both ends of a transfer that cut it the same way agree.
        """
        if len(units) == 1 and len(units[0]) == 1 and units[0][0].is_cpu:
            t = units[0][0]  # the common case: one CPU tensor, one Part
            h, s = fingerprint_cpu(t, hash, summary)
            return cls(side, ALGO_XXH3 if hash else "",
                       [Part(owners[0] if owners is not None else -1, h, s)], hash, summary)
        first = next((u[0] for u in units if u), None)
        algo = algo_for(first) if first is not None and hash else ""
        parts = []
        for i, unit in enumerate(units):
            part = Part(owners[i] if owners is not None else -1)
            if all(t.device.type == "cpu" for t in unit):
                prints = [fingerprint_cpu(t, hash, summary) for t in unit]
                hashes = [h for h, _ in prints] if hash else []
                sums = [s for _, s in prints] if summary else []
                part.hash = _one(hashes)
                part.summary = combine_summaries(sums)
            else:  # on the device both are cheap and share one transfer
                part.pending = [DevicePrint.start(t) for t in unit]
            parts.append(part)
        return cls(side, algo, parts, hash, summary)

    def ready(self) -> bool:
        return all(p.pending is None or all(d.ready() for d in p.pending) for p in self.parts)

    def resolve(self) -> tuple[tuple[int, int], Summary, list[Chunk]]:
        parts = self.parts
        if len(parts) == 1 and parts[0].pending is None and parts[0].owner < 0:
            return parts[0].hash, parts[0].summary, []
        for p in self.parts:
            if p.pending is not None:
                values = [d.values() for d in p.pending]
                p.hash = _one([h for h, _ in values]) if self.hashed else (0, 0)
                p.summary = combine_summaries([s for _, s in values]) if self.summarized \
                    else ZERO_SUMMARY
                p.pending = None
        if all(p.owner < 0 for p in self.parts):
            if len(self.parts) == 1:
                return self.parts[0].hash, self.parts[0].summary, []
            return (combine_hashes([p.hash for p in self.parts]),
                    combine_summaries([p.summary for p in self.parts]), [])
        chunks = [Chunk(self.side, p.owner, p.hash[0], p.hash[1], p.summary[0])
                  for p in self.parts]
        return (combine_hashes([p.hash for p in self.parts]),
                combine_summaries([p.summary for p in self.parts]), chunks)
