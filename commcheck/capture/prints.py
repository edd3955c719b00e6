"""Fingerprints of one side (input or output) of a call, possibly cut into per-rank chunks.

CPU parts are computed at once; device parts are :class:`DevicePrint` objects that the
sender thread resolves once their event fired. Chunked sides combine their chunk hashes
(xxh3-128 over the chunk digests in rank order), so a whole-side hash costs no second pass
and stays position-aware.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ..fingerprint import (
    ZERO_SUMMARY,
    DevicePrint,
    Summary,
    algo_for,
    hash_cpu,
    summary_cpu,
)
from ..wire import Chunk


def combine_hashes(hashes: list[tuple[int, int]]) -> tuple[int, int]:
    h = xxhash.xxh3_128_intdigest(np.asarray(hashes, dtype="<u8").tobytes())
    return h & ((1 << 64) - 1), h >> 64


def combine_summaries(parts: list[Summary]) -> Summary:
    if not parts:
        return ZERO_SUMMARY
    return (
        sum(p[0] for p in parts),
        max(p[1] for p in parts),
        sum(p[2] for p in parts),
        sum(p[3] for p in parts),
    )


@dataclass
class Part:
    owner: int  # global rank the chunk belongs to; -1 for an unchunked side
    hash: tuple[int, int] = (0, 0)
    summary: Summary = ZERO_SUMMARY
    pending: DevicePrint | None = None


@dataclass
class SidePrint:
    side: int
    algo: str
    parts: list[Part]

    hashed: bool = True
    summarized: bool = True

    @classmethod
    def take(cls, side: int, tensors: list[torch.Tensor], owners: list[int] | None, *,
             hash: bool, summary: bool) -> SidePrint:
        """Fingerprint now (CPU) or enqueue on the device; one Part per chunk."""
        algo = algo_for(tensors[0]) if tensors and hash else ""
        parts = []
        for i, t in enumerate(tensors):
            owner = owners[i] if owners is not None else -1
            if t.device.type == "cpu":
                parts.append(Part(owner, hash_cpu(t) if hash else (0, 0),
                                  summary_cpu(t) if summary else ZERO_SUMMARY))
            else:  # on the device both are cheap and share one transfer
                parts.append(Part(owner, pending=DevicePrint.start(t)))
        return cls(side, algo, parts, hash, summary)

    def ready(self) -> bool:
        return all(p.pending is None or p.pending.ready() for p in self.parts)

    def resolve(self) -> tuple[tuple[int, int], Summary, list[Chunk]]:
        for p in self.parts:
            if p.pending is not None:
                p.hash, p.summary = p.pending.values()
                p.pending = None
        if len(self.parts) == 1 and self.parts[0].owner < 0:
            return self.parts[0].hash, self.parts[0].summary, []
        chunks = [Chunk(self.side, p.owner, p.hash[0], p.hash[1], p.summary[0])
                  for p in self.parts]
        return (combine_hashes([p.hash for p in self.parts]),
                combine_summaries([p.summary for p in self.parts]), chunks)
