"""The native CPU statistics kernel against numpy, on every code path it has: AVX-512, AVX2
and scalar loops (the vector ones to the same bits), one to several OpenMP threads, the inline
and the separate hash (64 and 128 bits), lengths that leave tails in every loop,
NaN/Inf/signed zeros; sums that do not depend on the thread count; the collective
fingerprints built on it; and the fallback when no compiler can build it."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
import xxhash

from commcheck.gradprobe import stats
from commcheck.native import loader as native

BOUNDS = np.array([-1.0, -0.25, 0.0, 1e-3, 0.5, 1.0, 2.0, 3.0, 4.0], dtype=np.float32)
PIECE = 4096  # kernel.c's piece length: ranges and thread shares are cut on it


def require_kernel() -> native.Kernel:
    """The kernel must build wherever a C compiler exists; without one the tests skip."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler: the probe runs on torch kernels here")
    kernel = native.kernel()
    assert kernel is not None, "a C compiler exists, yet the kernel did not build"
    return kernel


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    require_kernel()
    return ctypes.CDLL(str(native._build()))


def kernels(lib: ctypes.CDLL) -> dict[str, native.Kernel]:
    xxh3 = native._load_xxh3()
    assert xxh3 is not None, "xxhash exports XXH3_* on the test machines"
    return {
        "avx512": native.Kernel(lib, xxh3),  # AVX2 where the CPU has no AVX-512
        "avx2": native.Kernel(lib, xxh3, vector=1),
        "scalar": native.Kernel(lib, xxh3, vector=0),
        "outside-hash": native.Kernel(lib, None),
    }


def sample(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 2
    x[::7] = 0.0
    x[3::13] = -0.0
    x[5::11] = 1e-3  # exactly on a bound: "<=" must count it
    return x


def expected(x: torch.Tensor) -> dict:
    a = x.numpy()
    wide = a.astype(np.float64)
    return {
        "low": float(a.min()),
        "high": float(a.max()),
        "sum": float(wide.sum()),
        "sumsq": float(np.square(wide).sum()),
        "positive": int((a > 0).sum()),
        "zeros": int((a == 0).sum()),
        "le": tuple(int((a <= b).sum()) for b in BOUNDS),
        "dir": a > 0,
        64: xxhash.xxh3_64_intdigest(a.tobytes()),
        128: xxhash.xxh3_128_intdigest(a.tobytes()),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 7, 8, 15, 17, PIECE - 1, PIECE + 9, 3 * PIECE + 5, 100_003])
def test_kernel_matches_numpy(lib: ctypes.CDLL, n: int) -> None:
    x = sample(n, n)
    want = expected(x)
    vector_sums = set()
    for name, kernel in kernels(lib).items():
        sums = set()
        for threads, bits in ((1, 64), (2, 128), (3, 64), (7, 128)):
            direction = torch.zeros(n, dtype=torch.bool)
            got, digest = kernel.stats(x, direction, BOUNDS, threads, bits)
            where = f"{name}, {threads} threads"
            assert (got.low, got.high) == (want["low"], want["high"]), where
            assert got.sum == pytest.approx(want["sum"], rel=1e-12, abs=1e-9), where
            assert got.sumsq == pytest.approx(want["sumsq"], rel=1e-12), where
            sums.add((got.sum, got.sumsq))
            assert (got.positive, got.zeros, got.le) == (
                want["positive"],
                want["zeros"],
                want["le"],
            ), where
            assert np.array_equal(direction.numpy(), want["dir"]), where
            assert digest == want[bits], where
        assert len(sums) == 1, f"{name}: sums depend on the thread count: {sums}"
        if kernel.vector:
            vector_sums |= sums
    assert len(vector_sums) == 1, f"AVX2 and AVX-512 sum differently: {vector_sums}"


@pytest.mark.timeout(60)
def test_statistics_only_when_asked(lib: ctypes.CDLL) -> None:
    """No direction, no bounds, no hash: the outputs that were not asked for stay untouched."""
    x = sample(5 * PIECE + 3, 1)
    got, digest = kernels(lib)["avx2"].stats(x, threads=2)
    assert digest is None and (got.positive, got.zeros, got.le) == (0, 0, ())
    assert (got.low, got.high) == (float(x.min()), float(x.max()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", [0, 9, PIECE + 1, 3 * PIECE + 2])
def test_nan_and_inf(lib: ctypes.CDLL, where: int) -> None:
    """NaN anywhere (vector body, tail, another thread's share) makes min and max NaN and is
    neither positive, zero nor below a bound; Inf is an ordinary extreme."""
    for name, kernel in kernels(lib).items():
        x = sample(3 * PIECE + 3, 2)
        x[where] = float("nan")
        clean = x[~torch.isnan(x)]
        got, _ = kernel.stats(x, None, BOUNDS, 3)
        assert np.isnan(got.low) and np.isnan(got.high) and np.isnan(got.sumsq), name
        assert np.isnan(got.sum), name
        assert got.positive == int((clean > 0).sum()) and got.zeros == int((clean == 0).sum())
        assert got.le == tuple(int((clean <= float(b)).sum()) for b in BOUNDS), name
        x[where] = float("inf")
        x[where - 1] = float("-inf")
        got, _ = kernel.stats(x, threads=3)
        assert (got.low, got.high, got.sumsq) == (float("-inf"), float("inf"), float("inf"))
        assert np.isnan(got.sum)


@pytest.mark.timeout(60)
def test_engine_uses_the_kernel_for_float32_only() -> None:
    """bf16 takes the block path, a transposed gradient the kernel (reshape copies it); the
    rows agree with each other and with torch."""
    require_kernel()
    engine = stats.StatEngine()
    base = sample(stats.SMALL_NUMEL * 4, 3).view(256, -1)
    grads = [base, base.t(), base.to(torch.bfloat16)]
    plan = stats.make_plan(["a", "b", "c"], grads, (0.0,), "L2")
    dirs = [torch.empty(g.shape, dtype=torch.bool) for g in grads]
    table, _ = engine.compute(plan, grads, dirs).ready()
    assert engine.host_kernel().accepts(base.reshape(-1))
    assert not engine.host_kernel().accepts(base.to(torch.bfloat16).reshape(-1))
    assert list(table[0, :2]) == list(table[1, :2])
    assert table[0, 2] == pytest.approx(table[1, 2], rel=1e-6)
    assert torch.equal(dirs[1], base.t() > 0)
    assert table[2, 0] == float(grads[2].max()) and table[2, 1] == float(grads[2].min())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compiler", ["false", "no-such-cc-commcheck"])
def test_no_compiler_falls_back_to_torch(tmp_path, monkeypatch, caplog, compiler) -> None:
    """A source tree without the kernel built with the package, and no compiler."""
    monkeypatch.setattr(native, "installed_library", lambda: None)
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.kernel.cache_clear()
    try:
        engine = stats.StatEngine()
        with caplog.at_level(logging.WARNING, logger="commcheck"):
            assert engine.host_kernel() is None
        assert [r.message for r in caplog.records if "native" in r.message][0].count("\n") == 0
        assert not list(tmp_path.rglob("*.so"))
        grads = [sample(stats.SMALL_NUMEL * 2, 4)]
        plan = stats.make_plan(["w"], grads, (0.0,), "L0")
        table, hashes = engine.compute(plan, grads, None).ready()
        assert hashes == [xxhash.xxh3_64_hexdigest(grads[0].numpy().tobytes())]
        assert table[0, 0] == float(grads[0].max())
    finally:
        native.kernel.cache_clear()


@pytest.mark.timeout(120)
def test_build_is_cached_per_user(tmp_path, monkeypatch) -> None:
    require_kernel()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native._build()
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "commcheck" and first.suffix == ".so"
    assert native._build() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp file left


@pytest.mark.timeout(120)
def test_unwritable_cache_builds_in_temp(tmp_path, monkeypatch) -> None:
    """A read-only home (EPERM/EACCES/EROFS) moves the build to a per-user temp folder."""
    require_kernel()
    monkeypatch.setenv("XDG_CACHE_HOME", "/sys")  # mkdir there fails with EPERM, even as root
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    built = native._build()
    assert built.parent == tmp_path / f"commcheck-{os.getuid()}" and built.exists()


@pytest.mark.timeout(120)
def test_threads_hash_independently(lib: ctypes.CDLL) -> None:
    """Two probes stepping in two threads share the kernel, not a hash state."""
    from concurrent.futures import ThreadPoolExecutor

    kernel = kernels(lib)["avx2"]
    data = [sample(PIECE * 64 + i, i) for i in range(8)]

    def digest(x: torch.Tensor) -> int | None:
        return kernel.stats(x, hash_bits=64)[1]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(digest, data * 4))
    assert got == [xxhash.xxh3_64_intdigest(x.numpy().tobytes()) for x in data * 4]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poison", ["", "nan", "inf"])
def test_collective_fingerprints_from_the_kernel(monkeypatch, poison: str) -> None:
    """A large float32 tensor's hash and summary (one kernel read) equal the torch path's:
    the same xxh3-128, the same abs-max and NaN/Inf counts, the sum to float64 rounding."""
    from commcheck.rank import fingerprint
    from commcheck.rank.prints import SidePrint

    require_kernel()
    base = sample(fingerprint._SMALL * 3 + 5, 7)
    if poison:
        base[123] = float(poison)
        base[7000] = -float(poison)
    cases = [base, base[: base.numel() // 2 * 2].view(2, -1).t()]  # contiguous and strided
    paths = {"fused": 0, "torch": 0}
    real_stats, real_torch = native.Kernel.stats, fingerprint._summary_torch

    def kernel_read(self, *args, **kwargs):
        paths["fused"] += kwargs.get("hash_bits") == 128  # hash and summary in one read
        return real_stats(self, *args, **kwargs)

    def torch_summary(x):
        paths["torch"] += 1
        return real_torch(x)

    monkeypatch.setattr(native.Kernel, "stats", kernel_read)
    monkeypatch.setattr(fingerprint, "_summary_torch", torch_summary)
    fast = [fingerprint.fingerprint_cpu(t, True, True) for t in cases]
    # One kernel read per tensor for hash and summary together; only NaN/Inf, which the
    # kernel does not count, add the torch summary.
    assert paths == {"fused": 2, "torch": 2 if poison else 0}
    if poison:
        assert fast[0][1][2:] == ((2, 0) if poison == "nan" else (0, 2))
    else:
        assert fast[0][1][0] == native.kernel().stats(base)[0].sum
    side = SidePrint.take(0, [[cases[0]]], None, hash=True, summary=True).resolve()
    monkeypatch.setattr(native, "kernel", lambda: None)
    slow = [(fingerprint.hash_cpu(t), fingerprint.summary_cpu(t)) for t in cases]
    for (fh, fs), (sh, ss) in zip(fast, slow, strict=True):
        assert fh == sh
        assert fs[1:] == ss[1:]
        assert fs[0] == pytest.approx(ss[0], rel=1e-9, abs=1e-6, nan_ok=True)
    assert (side[0], side[1][1:]) == (slow[0][0], slow[0][1][1:])
    if not poison:  # the kernel's summary path too, not only the fused one
        monkeypatch.undo()
        assert fingerprint.summary_cpu(base)[1:] == slow[0][1][1:]
        assert fingerprint.summary_cpu(base)[0] == fast[0][1][0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poison", ["", "nan", "inf"])
def test_fingerprint_bits_do_not_depend_on_the_vector_width(lib: ctypes.CDLL, poison) -> None:
    """Ranks on AVX2 and AVX-512 hosts fingerprint identical float32 data to identical bits."""
    fp = native.fingerprinter()
    assert fp is not None
    if native.kernel().vector < 2:
        pytest.skip("no AVX-512 on this CPU")
    lib.cc_limit_vector.argtypes = [ctypes.c_int]
    for n in (1, 15, 17, 4095, PIECE + 9, 3 * PIECE + 5, 100_003):
        t = sample(n, n)
        if poison and n > 20:
            t[n // 2], t[n - 3] = float(poison), -float(poison)
        got = {}
        try:
            for level in (1, 2):
                assert lib.cc_limit_vector(level) == level
                got[level] = fp(t, fp.code(t), True, True)
        finally:
            lib.cc_limit_vector(2)
        assert repr(got[1]) == repr(got[2]), n  # repr: NaN sums compare equal too
        h0, h1 = got[2][0]
        assert h1 << 64 | h0 == xxhash.xxh3_128_intdigest(t.numpy().tobytes()), n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poison", ["", "nan", "inf"])
def test_one_thread_fingerprint_equals_the_threaded_one(monkeypatch, poison: str) -> None:
    """A rank with one CPU of its own (4 ranks on 2 cores) fingerprints a large float32 tensor
    with the small tensors' single call, to the bits the threaded kernel gives."""
    from commcheck.rank import fingerprint

    require_kernel()
    base = sample(fingerprint._SMALL * 3 + 5, 9)
    if poison:
        base[77], base[PIECE * 2 + 1] = float(poison), -float(poison)
    cases = [base, base[: base.numel() // 2 * 2].view(2, -1).t()]
    monkeypatch.setattr(fingerprint, "host_threads", lambda: 2)
    threaded = [fingerprint.fingerprint_cpu(t, True, True) for t in cases]

    def no_kernel(*args, **kwargs):
        raise AssertionError("one thread: the statistics kernel is not called")

    monkeypatch.setattr(fingerprint, "host_threads", lambda: 1)
    monkeypatch.setattr(native.Kernel, "stats", no_kernel)
    one = [fingerprint.fingerprint_cpu(t, True, True) for t in cases]
    assert repr(one) == repr(threaded)  # repr: NaN sums compare equal too
    if poison:
        assert one[0][1][2:] == ((2, 0) if poison == "nan" else (0, 2))


SMALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("poison", ["", "nan", "inf"])
@pytest.mark.parametrize("n", [0, 1, 7, 1024, 1 << 16])
def test_small_fingerprint_native_equals_numpy_and_torch(monkeypatch, dtype, poison, n):
    """One native call gives the bits the numpy/torch path gives: the same hash, abs-max and
    NaN/Inf counts, and the float64 sum up to summation order (exact on these data)."""
    from commcheck.rank import fingerprint

    require_kernel()
    if poison and not dtype.is_floating_point:
        pytest.skip("integers hold no NaN/Inf")
    gen = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=gen) * 50).to(dtype)
    if poison and n > 3:
        t[1], t[3] = float(poison), -float(poison) if poison == "inf" else float(poison)
    fp = native.fingerprinter()
    assert fp is not None
    got = fp(t, fp.code(t), True, True)
    monkeypatch.setattr(fingerprint, "_native_small", None)  # the numpy/torch path
    want = (fingerprint.hash_cpu(t), fingerprint.summary_cpu(t))
    assert got[0] == want[0]
    assert got[1][1:] == want[1][1:]
    assert got[1][0] == pytest.approx(want[1][0], rel=1e-12, abs=1e-9, nan_ok=True)
    assert fingerprint.fingerprint_cpu(t, False, True)[0] == (0, 0)
    monkeypatch.undo()
    again = fingerprint.fingerprint_cpu(t, True, True)
    assert again[0] == got[0]
    assert [repr(x) for x in again[1]] == [repr(x) for x in got[1]]  # repr: NaN equals NaN
    assert fingerprint.fingerprint_cpu(t, True, False) == (got[0], fingerprint.ZERO_SUMMARY)
