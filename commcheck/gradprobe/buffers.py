"""Reusable, page-aligned host buffers that hold one step's direction arrays.

Each buffer is laid out as the final ``.npy`` file: the ``np.save`` header, then one byte per
element. ``torch.gt(grad, 0, out=...)`` writes straight into it and the writer hands the whole
region to ``write(2)`` with ``O_DIRECT``: no bool conversion copy, no ``np.save``, no page-cache
copy (which costs more CPU than the comparison itself on small VMs). Buffers are recycled
through a fixed number of slots, so memory stays bounded by ``max_pending_mib``, and
no page faults are taken on the training thread after the first steps.
"""

from __future__ import annotations

import math
import mmap
import queue
from dataclasses import dataclass

import torch

from commcheck.gradprobe.layout import npy_header

PAGE = mmap.PAGESIZE
MAX_SLOTS = 64


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


@dataclass
class HostBuffer:
    """An ``.npy`` image in host memory: ``header`` bytes followed by the direction bytes."""

    storage: mmap.mmap | torch.Tensor
    header_len: int
    nbytes: int
    tensor: torch.Tensor

    def region(self) -> memoryview:
        """The page-aligned region (a whole number of pages) that ``O_DIRECT`` writes need."""
        if isinstance(self.storage, mmap.mmap):
            return memoryview(self.storage)
        return memoryview(self.storage.numpy())

    @property
    def aligned(self) -> bool:
        if isinstance(self.storage, mmap.mmap):
            return True
        return self.storage.data_ptr() % PAGE == 0


def allocate(shape: tuple[int, ...], device: torch.device) -> HostBuffer:
    """A bool host buffer shaped like the gradient; pinned when the gradient is on a device."""
    header = npy_header(shape)
    nbytes = len(header) + math.prod(shape)
    size = _round_up(max(nbytes, 1))
    if device.type == "cpu":
        storage: mmap.mmap | torch.Tensor = mmap.mmap(-1, size)
        storage[: len(header)] = header
        raw = torch.frombuffer(storage, dtype=torch.uint8)
    else:
        storage = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        storage[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        raw = storage
    tensor = raw[len(header) : nbytes].view(torch.bool).view(shape)
    return HostBuffer(storage=storage, header_len=len(header), nbytes=nbytes, tensor=tensor)


@dataclass
class DirectionSlot:
    """One step's worth of direction buffers, in the order of a :class:`StatPlan`."""

    buffers: list[HostBuffer]

    @property
    def tensors(self) -> list[torch.Tensor | None]:
        return [b.tensor for b in self.buffers]


def slot_bytes(shapes: tuple[tuple[int, ...], ...]) -> int:
    return sum(_round_up(len(npy_header(s)) + math.prod(s)) for s in shapes)


class SlotPool:
    """Slots for one parameter list, as many as ``budget`` bytes allow (at least one, at most
    ``MAX_SLOTS``); slots are created lazily and recycled, never freed while the probe lives.
    """

    def __init__(self, shapes: tuple[tuple[int, ...], ...], device: torch.device, budget: int):
        self._shapes = shapes
        self._device = device
        self._free: queue.Queue[DirectionSlot] = queue.Queue()
        self._created = 0
        self.limit = max(1, min(MAX_SLOTS, budget // max(1, slot_bytes(shapes))))

    def acquire(self, block: bool) -> DirectionSlot | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._created < self.limit:
            self._created += 1
            return DirectionSlot([allocate(s, self._device) for s in self._shapes])
        if not block:
            return None
        return self._free.get()

    def release(self, slot: DirectionSlot) -> None:
        self._free.put(slot)
