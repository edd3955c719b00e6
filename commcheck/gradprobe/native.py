"""The one-pass CPU statistics kernel (``native.c``): built on first use, loaded with ctypes.

Like Triton's launchers, the C source ships with the package and is compiled with the system C
compiler (``$CC``, else ``cc``) into a per-user cache the first time a probe needs it (~0.4 s),
keyed by the source, the compiler and the machine, so nodes sharing a home directory never load
each other's builds. No compiler, a failed build or an unloadable library is not an error: the
probe logs one line and computes the same statistics with torch kernels (slower on CPUs).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

log = logging.getLogger("commcheck.gradprobe")

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O2", "-shared", "-fPIC")
# -fopenmp binds to the libgomp torch already loaded (same soname); without OpenMP support the
# kernel still builds and runs on one thread.
OPENMP = ("-fopenmp",)
BUILD_TIMEOUT_S = 120


@dataclass(frozen=True)
class HostStats:
    """One kernel call's results; ``positive``/``zeros``/``le`` are 0/() unless counted."""

    low: float
    high: float
    sumsq: float
    positive: int = 0
    zeros: int = 0
    le: tuple[int, ...] = ()


class Kernel:
    """Calls ``cc_stats`` on contiguous float32 CPU tensors; callable from several threads."""

    def __init__(self, lib: ctypes.CDLL, xxh3: Xxh3 | None, vector: bool = True) -> None:
        self._stats = lib.cc_stats
        self._stats.restype = ctypes.c_int
        self._stats.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        self._avx2 = int(lib.cc_has_avx2()) if vector else 0
        self._xxh3 = xxh3

    @staticmethod
    def accepts(flat: torch.Tensor) -> bool:
        return (
            flat.dtype == torch.float32
            and flat.device.type == "cpu"
            and flat.is_contiguous()
            and not flat.is_neg()
        )

    def stats(
        self,
        flat: torch.Tensor,
        direction: torch.Tensor | None,
        bounds: np.ndarray | None,
        hashed: bool,
        threads: int,
    ) -> tuple[HostStats, str | None]:
        """One pass over ``flat`` on ``threads`` threads; fills ``direction`` with ``flat > 0``.

        ``direction`` must be a contiguous bool tensor of the same length. ``bounds`` (float32)
        requests the positive, zero and ``<= bound`` counts. ``hashed``: also the xxh3-64 of the
        bytes, inside the same call when the xxhash package exports its XXH3 functions, else
        read again by ``xxhash`` afterwards.
        """
        out = np.zeros(3, dtype=np.float64)
        counts = None if bounds is None else np.zeros(2 + bounds.size, dtype=np.int64)
        inline = hashed and self._xxh3 is not None
        state = self._xxh3.reset() if inline else None
        failed = self._stats(
            flat.data_ptr(),
            flat.numel(),
            direction.data_ptr() if direction is not None else None,
            bounds.ctypes.data if bounds is not None else None,
            bounds.size if bounds is not None else 0,
            out.ctypes.data,
            counts.ctypes.data if counts is not None else None,
            self._avx2,
            self._xxh3.update if inline else None,
            state,
            threads,
        )
        if failed:
            raise MemoryError("gradprobe: native kernel could not allocate its counters")
        digest = None
        if inline:
            digest = self._xxh3.hexdigest(state)
        elif hashed:
            digest = xxhash.xxh3_64_hexdigest(flat.view(torch.uint8).numpy())
        low, high, sumsq = (float(v) for v in out)
        if counts is None:
            return HostStats(low, high, sumsq), digest
        got = HostStats(
            low, high, sumsq, int(counts[0]), int(counts[1]), tuple(int(c) for c in counts[2:])
        )
        return got, digest


class Xxh3:
    """The xxhash package's own XXH3 streaming functions (its extension exports them), so the
    kernel can hash on a thread of its own and the digest equals ``xxhash.xxh3_64``.

    One state per calling thread (two probes may step in two threads); never freed, ~600 B.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._create = lib.XXH3_createState
        self._create.restype = ctypes.c_void_p
        self._reset = lib.XXH3_64bits_reset
        self._reset.argtypes = [ctypes.c_void_p]
        self._digest = lib.XXH3_64bits_digest
        self._digest.argtypes = [ctypes.c_void_p]
        self._digest.restype = ctypes.c_uint64
        self.update = ctypes.cast(lib.XXH3_64bits_update, ctypes.c_void_p).value
        if not self.update:
            raise OSError("XXH3 update function unavailable")
        self._local = threading.local()

    def reset(self) -> int:
        """This thread's state, reset for a new stream."""
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = self._create()
            if not state:
                raise MemoryError("gradprobe: XXH3_createState failed")
        self._reset(state)
        return state

    def hexdigest(self, state: int) -> str:
        return f"{self._digest(state):016x}"


@functools.cache
def kernel() -> Kernel | None:
    """The loaded kernel, or None (logged once) when it cannot be built or loaded here."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("gradprobe: native CPU kernel unavailable (%s); using torch kernels", exc)
        return None
    return Kernel(lib, _load_xxh3())


def _load_xxh3() -> Xxh3 | None:
    try:
        return Xxh3(ctypes.CDLL(xxhash._xxhash.__file__))
    except (OSError, AttributeError):
        return None


def _build() -> Path:
    """Path of the built library: the cached one, else compiled now (atomically renamed into
    place, so ranks of one node building at once are harmless)."""
    compiler = os.environ.get("CC") or "cc"
    found = shutil.which(compiler)
    if found is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    key = hashlib.sha256(
        b"\0".join(
            [
                SOURCE.read_bytes(),
                found.encode(),
                _version(found),
                platform.machine().encode(),
                " ".join(FLAGS + OPENMP).encode(),
            ]
        )
    ).hexdigest()[:20]
    name = f"gradstats-{key}.so"
    fallback = Path(tempfile.gettempdir()) / f"commcheck-{os.getuid()}"
    try:
        return _compile_into(_cache_dir() / name, found)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return _compile_into(fallback / name, found)


def _compile_into(target: Path, compiler: str) -> Path:
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (OPENMP, ()):
            done = subprocess.run(
                [compiler, *FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
            if done.returncode == 0:
                break
        else:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise OSError(f"{os.path.basename(compiler)} failed: {first}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _version(compiler: str) -> bytes:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return b""
    return done.stdout


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "commcheck"
