"""Both CPU paths match a plain reference bit for bit: max/min/norm, bucket counts, zero
counts, directions and the L0 hash. The block path (torch/numpy kernels) is held to the
original per-chunk float32 norms; the native kernel to the float64 norm rounded once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from commcheck.gradprobe import stats
from tests.unit.test_native import require_kernel

BOUNDS = (-0.5, 0.0, 0.25, 3.0)


def reference(
    grad: torch.Tensor, native: bool
) -> tuple[list[float], list[int], torch.Tensor, str]:
    """The original algorithm: one torch kernel per statistic on every CHUNK-element piece."""
    flat = grad.reshape(-1)
    if native:
        norm = np.float32(np.sqrt(np.square(flat.double().numpy()).sum()))
    else:
        pieces = list(flat.split(stats.CHUNK))
        norms = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32) for p in pieces])
        norm = norms.double().square().sum().sqrt().float()
    cells = [float(flat.max().float()), float(flat.min().float()), float(norm)]
    wide = flat.float()
    counts = [int((wide <= float(np.float32(b))).sum()) for b in BOUNDS]
    counts.append(int(torch.count_nonzero(flat)))
    digest = xxhash.xxh3_64_hexdigest(flat.view(torch.uint8).numpy())
    return cells, counts, flat > 0, digest


def gradient(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=gen) * 10.0 ** (seed % 5 - 2)
    grad[::5] = 0.0
    grad[1::11] = -0.0
    grad[::17] = 0.25
    return grad.to(dtype)


@pytest.mark.parametrize("native", [True, False], ids=["native", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [stats.SMALL_NUMEL + 1, 3 * stats.CHUNK + 12345, 2 * stats.BLOCK])
def test_large_host_matches_reference(dtype: torch.dtype, n: int, native: bool) -> None:
    grads = [gradient(n, dtype, seed) for seed in range(2)]
    names = [f"p{i}" for i in range(len(grads))]
    engine = stats.StatEngine(native=native)
    if native:
        require_kernel()
    for level in ("L0", "L2"):
        plan = stats.make_plan(names, grads, BOUNDS, level)
        dirs = [torch.empty(g.shape, dtype=torch.bool) for g in grads] if level == "L2" else None
        table, hashes = engine.compute(plan, grads, dirs).ready()
        for i, grad in enumerate(grads):
            cells, counts, direction, digest = reference(grad, native and dtype == torch.float32)
            assert [float(np.float32(v)) for v in table[i, :3]] == cells
            if level == "L0":
                assert hashes is not None and hashes[i] == digest
            else:
                assert dirs is not None and torch.equal(dirs[i], direction)
                assert [int(round(c)) for c in table[i, 3:]] == counts
