"""The CPU fast path (blocks, row-wise norms, numpy signs) matches a plain per-chunk reference
bit for bit: max/min/norm, bucket counts, zero counts, directions and the L0 hash."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from commcheck.gradprobe import stats

BOUNDS = (-0.5, 0.0, 0.25, 3.0)


def reference(grad: torch.Tensor) -> tuple[list[float], list[int], torch.Tensor, str]:
    """The original algorithm: one torch kernel per statistic on every CHUNK-element piece."""
    flat = grad.reshape(-1)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [stats.SMALL_NUMEL + 1, 3 * stats.CHUNK + 12345, 2 * stats.BLOCK])
def test_large_host_matches_reference(dtype: torch.dtype, n: int) -> None:
    grads = [gradient(n, dtype, seed) for seed in range(2)]
    names = [f"p{i}" for i in range(len(grads))]
    engine = stats.StatEngine()
    for level in ("L0", "L2"):
        plan = stats.make_plan(names, grads, BOUNDS, level)
        dirs = [torch.empty(g.shape, dtype=torch.bool) for g in grads] if level == "L2" else None
        table, hashes = engine.compute(plan, grads, dirs).ready()
        for i, grad in enumerate(grads):
            cells, counts, direction, digest = reference(grad)
            assert [float(np.float32(v)) for v in table[i, :3]] == cells
            if level == "L0":
                assert hashes is not None and hashes[i] == digest
            else:
                assert dirs is not None and torch.equal(dirs[i], direction)
                assert [int(round(c)) for c in table[i, 3:]] == counts
