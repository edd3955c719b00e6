"""Per-parameter gradient statistics, batched, with one device-to-host transfer per step.

Large float32 CPU gradients go through the native kernel (``kernel.c``): one read of memory for
every statistic, on torch's OpenMP threads, the hash on a thread beside them. Other large CPU
gradients (bf16, fp16, fp64, or no C compiler) are streamed in cache-sized blocks with torch and
numpy kernels; on accelerators the statistics are whole-tensor kernels. Small ones (biases,
norms) are concatenated once and reduced per segment, so a model with thousands of tiny
parameters costs a handful of kernels, not thousands. All results are stacked into one float64
tensor and copied to the host once, asynchronously on accelerators.

Values follow msprobe: max/min/norm are computed in the gradient's dtype and reported as float32
(the native kernel sums squares in float64, so its norm is the exact one rounded once);
bucket counts compare against the bounds rounded to float32 (msprobe builds them with
``torch.Tensor(bounds)``), NaN lands in the last interval (as ``torch.bucketize`` puts it).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from commcheck.native.loader import Kernel, kernel

SMALL_NUMEL = 1 << 15
# Norms of CHUNK-element pieces are combined in float64: CHUNK fixes the bits of ``norm`` and
# must not change. BLOCK (a multiple of CHUNK) is what one pass over the cache reads: 8 MiB of
# float32 measured best on the 2-core reference box (2 norm rows, one per core).
CHUNK = 1 << 20
BLOCK = 2 * CHUNK
LOW_PRECISION = (torch.bfloat16, torch.float16)
NUMPY_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class StatPlan:
    """What to compute for a fixed list of parameters; rebuilt only when the list changes."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    large: tuple[int, ...]
    small: tuple[int, ...]
    empty: tuple[int, ...]
    bounds: tuple[float, ...]
    counts: bool
    hashes: bool
    small_numels: tuple[int, ...]
    small_lengths: torch.Tensor = field(repr=False, compare=False)
    order: torch.Tensor = field(repr=False, compare=False)

    @property
    def n_counts(self) -> int:
        return len(self.bounds) + 1 if self.counts else 0


def make_plan(
    names: list[str], grads: list[torch.Tensor], bounds: tuple[float, ...], level: str
) -> StatPlan:
    numels = tuple(int(g.numel()) for g in grads)
    empty = tuple(i for i, n in enumerate(numels) if n == 0)
    large = tuple(i for i, n in enumerate(numels) if n > SMALL_NUMEL)
    small = tuple(i for i, n in enumerate(numels) if 0 < n <= SMALL_NUMEL)
    device = grads[0].device if grads else torch.device("cpu")
    computed = large + small + empty
    order = torch.empty(len(grads), dtype=torch.long)
    order[list(computed)] = torch.arange(len(computed))
    return StatPlan(
        names=tuple(names),
        shapes=tuple(tuple(g.shape) for g in grads),
        numels=numels,
        large=large,
        small=small,
        empty=empty,
        bounds=bounds,
        counts=level == "L2",
        hashes=level == "L0",
        small_numels=tuple(numels[i] for i in small),
        small_lengths=torch.tensor([numels[i] for i in small], dtype=torch.long, device=device),
        order=order.to(device),
    )


@dataclass
class StepStats:
    """Statistics of one step; ``table`` may still be in flight until ``ready()`` returns."""

    plan: StatPlan
    table: torch.Tensor
    hashes: list[Future[str] | str] | None
    event: object | None = None

    def ready(self) -> tuple[np.ndarray, list[str] | None]:
        """Block (on the writer thread) until the host copy landed; return rows and hashes."""
        if self.event is not None:
            self.event.synchronize()
        hashes = None
        if self.hashes is not None:
            hashes = [h if isinstance(h, str) else h.result() for h in self.hashes]
        return self.table.numpy(), hashes


def hash_bytes(tensor: torch.Tensor) -> str:
    """xxh3-64 of the tensor's raw bytes in logical (C) order, in its own dtype."""
    flat = tensor.detach().contiguous().reshape(-1)
    return xxhash.xxh3_64_hexdigest(flat.view(torch.uint8).numpy())


class StatEngine:
    """Computes :class:`StepStats`; owns the reusable scratch buffer and the hashing threads."""

    def __init__(self, native: bool = True) -> None:
        self._native = native
        self._scratch: torch.Tensor | None = None
        self._np_scratch: np.ndarray | None = None
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def compute(
        self,
        plan: StatPlan,
        grads: list[torch.Tensor],
        directions: list[torch.Tensor | None] | None,
    ) -> StepStats:
        """Statistics for ``grads``; also fills ``directions[i]`` with ``grads[i] > 0``."""
        device = grads[0].device if grads else torch.device("cpu")
        on_cpu = device.type == "cpu"
        hashes: list[Future[str] | str] | None = None
        if plan.hashes:
            hashes = [
                self._hash(g, on_cpu) if i not in plan.large or not on_cpu else ""
                for i, g in enumerate(grads)
            ]
        parts = []
        if plan.large and on_cpu:
            parts.append(self._large_host(plan, grads, directions, hashes))
        elif plan.large:
            parts.append(self._large_device(plan, grads, directions))
        if plan.small:
            norms = torch.stack(torch._foreach_norm([grads[i] for i in plan.small])).float()
            parts.append(self._small(plan, grads, norms, directions))
        if plan.empty:
            blank = torch.zeros(len(plan.empty), 3 + plan.n_counts, dtype=torch.float64)
            blank[:, :3] = math.nan
            parts.append(blank.to(device))
        table = torch.cat(parts).index_select(0, plan.order) if parts else torch.zeros(0, 3)
        event = None
        if not on_cpu:
            host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            host.copy_(table, non_blocking=True)
            table = host
            event = _record_event(device)
        return StepStats(plan=plan, table=table, hashes=hashes, event=event)

    def _hash(self, grad: torch.Tensor, on_cpu: bool) -> Future[str] | str:
        return hash_bytes(grad) if on_cpu else self._device_hash(grad)

    def _large_host(
        self,
        plan: StatPlan,
        grads: list[torch.Tensor],
        directions: list[torch.Tensor | None] | None,
        hashes: list[Future[str] | str] | None,
    ) -> torch.Tensor:
        """One row per large CPU gradient: the native kernel when it takes it, else blocks."""
        host = self.host_kernel()
        rows = []
        for idx in plan.large:
            flat = grads[idx].reshape(-1)
            target = directions[idx] if directions else None
            dflat = target.view(-1) if target is not None else None
            if host is not None and host.accepts(flat) and (dflat is None or dflat.is_contiguous()):
                row, digest = self._native_row(host, plan, flat, dflat, hashes is not None)
            else:
                row, digest = self._blocks_row(plan, grads[idx], dflat, hashes is not None)
            if hashes is not None and digest is not None:
                hashes[idx] = digest
            rows.append(row)
        return torch.stack(rows)

    def host_kernel(self) -> Kernel | None:
        """The native CPU kernel if enabled and buildable here (built on first use)."""
        return kernel() if self._native else None

    @staticmethod
    def _native_row(
        host: Kernel,
        plan: StatPlan,
        flat: torch.Tensor,
        dflat: torch.Tensor | None,
        hashed: bool,
    ) -> tuple[torch.Tensor, str | None]:
        """Every statistic from one read of each 16 KiB piece, on torch's threads (``kernel.c``).

        The norm is the float64 sum of squares rounded to float32 once: more exact than torch's
        float32 reduction, whose bits it therefore does not always reproduce.
        """
        bounds = np.asarray(plan.bounds, dtype=np.float32) if plan.counts else None
        got, digest = host.stats(flat, dflat, bounds, torch.get_num_threads(), 64 if hashed else 0)
        cells = [got.high, got.low, float(np.float32(math.sqrt(got.sumsq)))]
        if plan.counts:
            cells += [*got.le, flat.numel() - got.zeros]
        return torch.tensor(
            cells, dtype=torch.float64
        ), None if digest is None else f"{digest:016x}"

    def _blocks_row(
        self, plan: StatPlan, grad: torch.Tensor, dflat: torch.Tensor | None, hashed: bool
    ) -> tuple[torch.Tensor, str | None]:
        """One pass over a gradient in cache-sized blocks, with torch and numpy kernels.

        Every statistic (min/max, norm, direction, counts, hash) reads the block while it is
        still in cache, so memory is streamed once instead of once per statistic; the norm is
        combined from the norms of ``CHUNK``-element pieces in float64 (exactly ``torch.norm``
        when there is one piece).
        """
        flat = grad.reshape(-1)
        on_numpy = grad.dtype in NUMPY_DTYPES and not flat.is_neg()
        fnp = flat.numpy() if on_numpy and (dflat is not None or plan.counts) else None
        dnp = dflat.numpy() if on_numpy and dflat is not None else None
        hasher = xxhash.xxh3_64() if hashed else None
        lows, highs, norms = [], [], []
        positive = zeros = 0
        for start in range(0, flat.numel(), BLOCK):
            stop = start + BLOCK
            block = flat[start:stop]
            low, high = torch.aminmax(block)
            lows.append(low)
            highs.append(high)
            norms += _piece_norms(block, grad.dtype)
            if fnp is not None:
                p, z = self._signs_numpy(fnp[start:stop], dnp, start, plan.counts)
            else:
                p, z = self._signs_torch(block, dflat, start, plan.counts)
            positive += p
            zeros += z
            if hasher is not None:
                hasher.update(block.view(torch.uint8).numpy())
        low, high = torch.stack(lows).min(), torch.stack(highs).max()
        norm = torch.cat(norms).double().square().sum().sqrt().float()
        cells = [high.float(), low.float(), norm]
        if plan.counts:
            pos = torch.tensor(positive) if dflat is not None else None
            cells += self._counts(grad, plan.bounds, low, high, pos, on_cpu=True)
            cells.append(torch.tensor(flat.numel() - zeros))
        row = torch.stack([c.to(torch.float64) for c in cells])
        return row, hasher.hexdigest() if hasher is not None else None

    def _signs_numpy(
        self, values: np.ndarray, directions: np.ndarray | None, start: int, counts: bool
    ) -> tuple[int, int]:
        """``grad > 0`` into the direction buffer; positive and zero counts if ``counts``.

        numpy's comparisons and bool counts are single-threaded SIMD loops: less CPU time than
        torch's for these memory-bound passes, and no OpenMP barrier, which costs a scheduler
        time slice whenever the other cores are busy. Same IEEE semantics: NaN is neither
        positive nor zero, ``-0.0`` is zero.
        """
        positive = zeros = 0
        if directions is not None:
            out = directions[start : start + values.size]
            np.greater(values, 0, out=out)
            if counts:
                positive = int(np.count_nonzero(out))
        if counts:
            if self._np_scratch is None or self._np_scratch.size < values.size:
                self._np_scratch = np.empty(BLOCK, dtype=np.bool_)
            scratch = self._np_scratch[: values.size]
            np.equal(values, 0, out=scratch)
            zeros = int(np.count_nonzero(scratch))
        return positive, zeros

    @staticmethod
    def _signs_torch(
        block: torch.Tensor, directions: torch.Tensor | None, start: int, counts: bool
    ) -> tuple[int, int]:
        positive = zeros = 0
        if directions is not None:
            out = torch.gt(block, 0, out=directions[start : start + block.numel()])
            if counts:
                positive = int(torch.count_nonzero(out))
        if counts:
            zeros = block.numel() - int(torch.count_nonzero(block))
        return positive, zeros

    def _device_hash(self, grad: torch.Tensor) -> Future[str] | str:
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        host.copy_(grad.detach(), non_blocking=True)
        event = _record_event(grad.device)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gradprobe-hash")

        def run() -> str:
            event.synchronize()
            return hash_bytes(host)

        return self._pool.submit(run)

    def _large_device(
        self,
        plan: StatPlan,
        grads: list[torch.Tensor],
        directions: list[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        """Whole-tensor kernels on accelerators; no host values, so no shortcuts."""
        norms = [n.float() for n in torch._foreach_norm([grads[i] for i in plan.large])]
        rows = []
        for pos, idx in enumerate(plan.large):
            grad = grads[idx]
            low, high = torch.aminmax(grad)
            direction = self._direction(grad, directions[idx] if directions else None)
            cells = [high.float(), low.float(), norms[pos]]
            if plan.counts:
                positive = torch.count_nonzero(direction) if direction is not None else None
                cells += self._counts(grad, plan.bounds, low, high, positive, on_cpu=False)
                cells.append(torch.count_nonzero(grad))
            rows.append(torch.stack([c.to(torch.float64) for c in cells]))
        return torch.stack(rows)

    @staticmethod
    def _direction(grad: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor | None:
        if target is None:
            return None
        if target.device == grad.device:
            torch.gt(grad, 0, out=target)
            return target
        on_device = torch.gt(grad, 0)
        target.copy_(on_device, non_blocking=True)
        return on_device

    def _counts(
        self,
        grad: torch.Tensor,
        bounds: tuple[float, ...],
        low: torch.Tensor,
        high: torch.Tensor,
        positive: torch.Tensor | None,
        on_cpu: bool,
    ) -> list[torch.Tensor]:
        """``count(grad <= b)`` for each bound.

        On the CPU min/max are host values already, so a bound outside ``[min, max)`` costs
        nothing and bound 0 follows from the positive count; NaN disables both shortcuts.
        """
        numel = grad.numel()
        lo = float(low) if on_cpu else math.nan
        hi = float(high) if on_cpu else math.nan
        out = []
        for bound in bounds:
            b32 = float(np.float32(bound))
            if hi <= b32:
                out.append(torch.tensor(numel))
            elif lo > b32:
                out.append(torch.tensor(0))
            elif b32 == 0 and positive is not None and not math.isnan(hi):
                out.append(numel - positive)
            else:
                out.append(torch.count_nonzero(self._le(grad, b32)))
        return [c.to(grad.device) for c in out]

    def _le(self, grad: torch.Tensor, b32: float) -> torch.Tensor:
        if grad.dtype in LOW_PRECISION:
            return grad.float() <= b32
        if grad.device.type != "cpu":
            return grad <= b32
        if self._scratch is None or self._scratch.numel() < grad.numel():
            self._scratch = torch.empty(grad.numel(), dtype=torch.bool)
        out = self._scratch[: grad.numel()].view(grad.shape)
        return torch.le(grad, b32, out=out)

    @staticmethod
    def _small(
        plan: StatPlan,
        grads: list[torch.Tensor],
        norm: torch.Tensor,
        directions: list[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        flat = torch.cat([grads[i].detach().reshape(-1).float() for i in plan.small])
        lengths = plan.small_lengths
        high = torch.segment_reduce(flat, "max", lengths=lengths)
        low = torch.segment_reduce(flat, "min", lengths=lengths)
        cols = [high.double(), low.double(), norm.double()]
        if plan.counts:
            masks = [flat <= float(np.float32(b)) for b in plan.bounds] + [flat != 0]
            stacked = torch.stack(masks, dim=1).double()
            counts = torch.segment_reduce(stacked, "sum", lengths=lengths, axis=0)
            cols += list(counts.unbind(1))
        if directions is not None:
            positive = flat > 0
            for piece, idx in zip(positive.split(plan.small_numels), plan.small, strict=True):
                target = directions[idx]
                if target is not None:
                    target.copy_(piece.view(target.shape), non_blocking=True)
        return torch.stack(cols, dim=1)


def _piece_norms(block: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Norms of the ``CHUNK``-element pieces of ``block``, as 1-D tensors.

    For float32, full pieces are reduced as the rows of one 2-D view: torch's last-dim norm
    kernel reduces each row sequentially on one thread, exactly as it reduces a 1-D tensor, so
    the bits equal one ``vector_norm`` call per piece while the rows run in parallel. Other
    dtypes take torch's generic reduction, whose order may depend on the shape: one call each.
    """
    out = []
    n = block.numel()
    full = n // CHUNK * CHUNK if dtype == torch.float32 else 0
    if full:
        rows = block[:full].view(-1, CHUNK)
        out.append(torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32))
    # float64 cannot be reduced "as float32" by torch: reduce in float64, then narrow.
    kw = {} if dtype == torch.float64 else {"dtype": torch.float32}
    for start in range(full, n, CHUNK):
        piece = block[start : start + CHUNK]
        out.append(torch.linalg.vector_norm(piece, **kw).to(torch.float32).view(1))
    return out


def _record_event(device: torch.device) -> object:
    module = getattr(torch, device.type, None)
    event = module.Event() if module is not None and hasattr(module, "Event") else None
    if event is None:
        raise RuntimeError(f"gradprobe: no event type for device {device}")
    event.record()
    return event
