"""Fingerprints hash exactly the view's bytes, position-aware, for every dtype."""

from __future__ import annotations

import math
import os
import sys
import time
import warnings

import pytest
import torch

from commcheck.rank.fingerprint import (
    ALGO_DEVICE,
    ALGO_XXH3,
    DevicePrint,
    algo_for,
    device_hash,
    device_summary,
    hash_cpu,
    summary_cpu,
)

pytestmark = pytest.mark.timeout(60)


def dev_hash(t: torch.Tensor) -> tuple[int, int]:
    return tuple(device_hash(t).tolist())


HASHES = [pytest.param(hash_cpu, id="xxh3"), pytest.param(dev_hash, id="device-fold")]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]


def sample(dtype: torch.dtype, n: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("h", HASHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_single_bit_flip_changes_the_hash(h, dtype):
    t = sample(dtype)
    base = h(t)
    raw = t.view(torch.uint8).reshape(-1) if t.dim() else t.reshape(1).view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            assert h(t) != base, (byte, bit)
            raw[byte] ^= 1 << bit
    assert h(t) == base


@pytest.mark.parametrize("h", HASHES)
def test_a_permutation_changes_the_hash(h):
    t = torch.arange(64, dtype=torch.float32)
    swapped = t.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert h(swapped) != h(t)
    assert h(t.flip(0)) != h(t)
    chunks = t.chunk(4)
    assert h(torch.cat([chunks[1], chunks[0], *chunks[2:]])) != h(t)


@pytest.mark.parametrize("h", HASHES)
def test_a_strided_view_hashes_only_its_own_elements(h):
    big = torch.randn(8, 10)
    view = big[:, ::2]
    assert not view.is_contiguous()
    before = h(view)
    assert before == h(view.contiguous())
    big[:, 1::2] += 1.0  # bytes outside the view, inside the same storage
    assert h(view) == before
    big[0, 0] += 1.0
    assert h(view) != before


@pytest.mark.parametrize("h", HASHES)
def test_same_values_same_hash_and_length_matters(h):
    a = torch.zeros(9, dtype=torch.uint8)
    assert h(a) == h(a.clone())
    assert h(a) != h(torch.zeros(10, dtype=torch.uint8))
    assert h(torch.zeros(0)) == h(torch.zeros(0))


def test_dtype_reinterpretation_is_byte_exact():
    t = torch.randn(16)
    assert hash_cpu(t) == hash_cpu(t.view(torch.int32))


def test_algorithm_tag():
    assert algo_for(torch.zeros(1)) == ALGO_XXH3
    assert ALGO_DEVICE != ALGO_XXH3
    if torch.cuda.is_available():
        assert algo_for(torch.zeros(1, device="cuda")) == ALGO_DEVICE


def test_summary_matches_float64_reference():
    t = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 3
    s, absmax, nan, inf = summary_cpu(t)
    # float32 partial sums over 256-element blocks, then float64: a few roundings per block.
    bound = 10 * 2.0**-24 * t.abs().double().sum().item()
    assert abs(s - t.double().sum().item()) <= bound
    assert absmax == t.abs().max().item()
    assert (nan, inf) == (0, 0)
    t[5], t[9], t[11] = float("nan"), float("inf"), float("-inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN in training data is not numpy's error to print
        s, absmax, nan, inf = summary_cpu(t)
    assert math.isnan(s) and (nan, inf) == (1, 2)
    assert absmax == float("inf")
    assert summary_cpu(torch.tensor([True, False, True])) == (2.0, 1.0, 0, 0)
    assert summary_cpu(torch.tensor([-7, 3])) == (-4.0, 7.0, 0, 0)
    assert summary_cpu(torch.zeros(0)) == (0.0, 0.0, 0, 0)
    bf = torch.tensor([1.5, -2.5], dtype=torch.bfloat16)
    assert summary_cpu(bf) == (-1.0, 2.5, 0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_print_matches_the_cpu_fold_without_sync():
    t = torch.randn(1 << 20, device="cuda")
    p = DevicePrint.start(t)
    torch.cuda.synchronize()
    assert p.ready()
    (h0, h1), summary = p.values()
    assert (h0, h1) == tuple(v & (2**64 - 1) for v in device_hash(t.cpu()).tolist())
    assert math.isclose(summary[0], t.double().sum().item(), rel_tol=1e-9)


@pytest.mark.timeout(300)  # Triton compiles a variant per dtype and alignment on first use
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_triton_fold_gives_the_torch_ops_bits():
    """One kernel, the same hash bits as device_hash and the summary of device_summary, for
    every dtype it takes, one program and many, aligned and 8-byte offset, NaN and Inf;
    fold() hands out None (the torch ops) until its thread has built the kernels."""
    from commcheck.rank import device_fold

    found = device_fold.kernels()
    if found is None:
        pytest.skip("no Triton")
    gen = torch.Generator(device="cuda").manual_seed(5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in (4, 1000, 4096, 3 << 17, (1 << 20) + 4):
            base = (torch.randn(n + 4, generator=gen, device="cuda") * 3).to(dtype)
            for t in (base[:n], base[4:]):
                if dtype == torch.float32 and n == 4096:
                    t[7], t[9], t[11] = float("nan"), float("inf"), -float("inf")
                with device_fold._compiling:  # no other thread's build beside this one
                    got = device_fold.launch(t, found)
                want = torch.cat([device_hash(t), device_summary(t).view(torch.int64)])
                assert got[:2].tolist() == want[:2].tolist(), (dtype, n)
                gs, ws = got[2:4].view(torch.float64).tolist(), want[2:4].view(torch.float64)
                assert math.isclose(gs[0], ws[0].item(), rel_tol=1e-9, abs_tol=1e-6) or \
                    (math.isnan(gs[0]) and math.isnan(ws[0].item())), (dtype, n)
                assert gs[1] == ws[1].item() and got[4:].tolist() == want[4:].tolist()
    t = torch.randn(777 * 2, device="cuda")
    deadline = time.monotonic() + 120
    while device_fold.fold(t) is None:
        assert time.monotonic() < deadline, "the kernels were never built"
        time.sleep(0.05)
    assert device_fold.fold(t)[:2].tolist() == device_hash(t).tolist()
    assert device_fold.fold(t[1:]) is None  # 4-byte offset: the torch ops


def test_native_passes_use_at_most_the_ranks_share_of_cpus(monkeypatch):
    """Four ranks on two CPUs: one thread each, whatever torch's own count says; the same
    fingerprint bits as any thread count."""
    from commcheck.rank import fingerprint as fpm

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    for local, want in ((str(2 * cpus), 1), ("1", cpus), ("bad", cpus)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        fpm._cpu_share.cache_clear()
        assert fpm.host_threads() == want
    fpm._cpu_share.cache_clear()
    x = torch.randn(1 << 18)
    odd = x.clone()
    odd[5], odd[9], odd[11] = float("nan"), float("inf"), float("-inf")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    wide = fpm.fingerprint_cpu(x, True, True)
    wide_sums = [fpm.fingerprint_cpu(t, False, True)[1] for t in (x, odd)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cpus))
    fpm._cpu_share.cache_clear()
    for t in (x, x.view(2, -1).t()):  # contiguous and strided, on one thread
        narrow = fpm.fingerprint_cpu(t, True, True)
        assert narrow[0] == fpm.hash_cpu(t)
        assert narrow[1][1:] == fpm.summary_cpu(t)[1:]
    assert fpm.fingerprint_cpu(x, True, True) == wide
    # the sums alone (a reduction's input) on one thread: the same bits, NaN/Inf counted
    assert fpm.fingerprint_cpu(x, False, True) == ((0, 0), wide[1])
    narrow_odd = fpm.fingerprint_cpu(odd, False, True)[1]
    assert math.isnan(narrow_odd[0]) and math.isnan(wide_sums[1][0])
    assert narrow_odd[1:] == wide_sums[1][1:] == (float("inf"), 1, 2)
    fpm._cpu_share.cache_clear()


def test_the_triton_fold_is_not_loaded_from_a_cache_others_can_write(tmp_path, monkeypatch,
                                                                      caplog):
    """Triton loads its launcher (a library) and kernels from its cache: one that another
    user could write is refused in one line, and the torch ops fingerprint device tensors."""
    import types

    from commcheck.rank import device_fold

    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))  # as if installed
    shared = tmp_path / "team"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may replace what is in it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared / "triton"))
    with caplog.at_level("WARNING"):
        assert device_fold._build() is None
    assert [r.getMessage() for r in caplog.records if "Triton's cache" in r.getMessage()] == [
        f"commcheck: refused Triton's cache for the device fingerprint ({shared}: writable by "
        f"other users (mode 777)); the torch ops fingerprint device tensors instead"]
    monkeypatch.setenv("COMMCHECK_TRITON", "0")
    assert device_fold._build() is None


def test_a_triton_fold_that_cannot_be_built_says_so_once_and_the_torch_ops_go_on(
        monkeypatch, caplog):
    """A build that fails (no GPU compiler, a device Triton cannot drive) is one line; that
    dtype stays on the torch ops."""
    from commcheck.rank import device_fold

    def broken(*a, **kw):
        raise RuntimeError("ptxas not found\nmore")

    monkeypatch.setattr(device_fold, "_kernels", ({(1,): broken}, None))
    monkeypatch.setattr(device_fold, "_ready", {})
    key = (torch.device("cpu"), torch.float16)
    with caplog.at_level("WARNING", "commcheck"):
        device_fold._warm_up(*key)
    assert key not in device_fold._ready
    [line] = [r.getMessage() for r in caplog.records if "Triton" in r.getMessage()]
    assert line.startswith("commcheck: the Triton device fingerprint cannot be built for "
                           "float16 on cpu (") and line.endswith(
        "); the torch ops fingerprint those tensors (slower)")
    assert device_fold.fold(torch.zeros(8, device="meta")) is None  # not CUDA: the torch ops
