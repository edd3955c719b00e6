"""The one-pass CPU statistics kernel (``kernel.c``), loaded with ctypes.

It serves the gradient probe's statistics and the fingerprints (hash + summary) of CPU
tensors in collectives. It is built with the package (``setup.py``: the extension
``commcheck.native._kernel``, which ``pip install`` compiles and a wheel carries) and loaded
from there. A source tree without it (or whose library was built from other sources) falls
back to the first-use build: the system C compiler (``$CC``, else ``cc``) compiles it into a
private per-user cache (:mod:`.private`: owner and mode checked, never another user's file)
the first time it is needed (~0.4 s), keyed by the source, the compiler and the machine, so
nodes sharing a home directory never load each other's builds. No compiler, a failed build
or an unloadable library is not an error: one log line, and the same statistics come from
torch kernels (slower on CPUs).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from . import private
from .toolchain import compiler_version

log = logging.getLogger("commcheck")

SOURCE = Path(__file__).with_name("kernel.c")
FLAGS = ("-O2", "-shared", "-fPIC")
# -fopenmp binds to the libgomp torch already loaded (same soname); without OpenMP support the
# kernel still builds and runs on one thread.
OPENMP = ("-fopenmp",)
BUILD_TIMEOUT_S = 120


@dataclass(frozen=True)
class HostStats:
    """One kernel call's results; ``positive``/``zeros``/``le`` are 0/() unless counted.

    ``low``/``high`` are NaN when any element is; ``sum``/``sumsq`` are float64 sums.
    """

    low: float
    high: float
    sum: float
    sumsq: float
    positive: int = 0
    zeros: int = 0
    le: tuple[int, ...] = ()


class Kernel:
    """Calls ``cc_stats`` on contiguous float32 CPU tensors; callable from several threads."""

    def __init__(self, lib: ctypes.CDLL, xxh3: Xxh3 | None, vector: int = 2) -> None:
        """``vector``: the widest loops to use, 0 scalar, 1 AVX2, 2 AVX-512 (same sums on
        each), capped at what the CPU runs."""
        self._lib = lib
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
        self.vector = min(int(vector), int(lib.cc_vector_support()))
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
        direction: torch.Tensor | None = None,
        bounds: np.ndarray | None = None,
        threads: int = 1,
        hash_bits: int = 0,
    ) -> tuple[HostStats, int | None]:
        """One pass over ``flat`` on ``threads`` threads; fills ``direction`` with ``flat > 0``.

        ``direction`` must be a contiguous bool tensor of the same length. ``bounds`` (float32)
        requests the positive, zero and ``<= bound`` counts. ``hash_bits`` 64 or 128: also
        the xxh3 digest of the bytes (as ``xxhash.xxh3_{64,128}_intdigest``), inside the same
        call when the xxhash package exports its XXH3 functions, else read again afterwards.
        """
        out = np.zeros(4, dtype=np.float64)
        counts = None if bounds is None else np.zeros(2 + bounds.size, dtype=np.int64)
        stream = self._xxh3.start(hash_bits) if hash_bits and self._xxh3 is not None else None
        failed = self._stats(
            flat.data_ptr(),
            flat.numel(),
            direction.data_ptr() if direction is not None else None,
            bounds.ctypes.data if bounds is not None else None,
            bounds.size if bounds is not None else 0,
            out.ctypes.data,
            counts.ctypes.data if counts is not None else None,
            self.vector,
            stream[0] if stream is not None else None,
            stream[1] if stream is not None else None,
            threads,
        )
        if failed:
            raise MemoryError("commcheck: native kernel could not allocate its buffers")
        digest = None
        if stream is not None:
            digest = self._xxh3.digest(hash_bits, stream[1])
        elif hash_bits:
            digest = _XXHASH_INT[hash_bits](flat.view(torch.uint8).numpy())
        low, high, sumsq, total = (float(v) for v in out)
        if counts is None:
            return HostStats(low, high, total, sumsq), digest
        more = (int(counts[0]), int(counts[1]), tuple(int(c) for c in counts[2:]))
        return HostStats(low, high, total, sumsq, *more), digest


_XXHASH_INT = {64: xxhash.xxh3_64_intdigest, 128: xxhash.xxh3_128_intdigest}


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


class Xxh3:
    """The xxhash package's own XXH3 streaming functions (its extension exports them), so the
    kernel can hash on a thread of its own and digests equal ``xxhash.xxh3_{64,128}``.

    One state per calling thread (two probes may step in two threads); never freed, ~600 B.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._create = lib.XXH3_createState
        self._create.restype = ctypes.c_void_p
        self._reset, self._update, self._digest = {}, {}, {}
        for bits, restype in ((64, ctypes.c_uint64), (128, _Hash128)):
            reset = getattr(lib, f"XXH3_{bits}bits_reset")
            reset.argtypes = [ctypes.c_void_p]
            digest = getattr(lib, f"XXH3_{bits}bits_digest")
            digest.argtypes = [ctypes.c_void_p]
            digest.restype = restype
            update = ctypes.cast(_update_fn(lib, bits), ctypes.c_void_p).value
            if not update:
                raise OSError(f"XXH3_{bits}bits_update unavailable")
            self._reset[bits], self._update[bits], self._digest[bits] = reset, update, digest
        self._local = threading.local()

    def start(self, bits: int) -> tuple[int, int]:
        """(update function, this thread's state reset for a new ``bits``-bit stream)."""
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = self._create()
            if not state:
                raise MemoryError("commcheck: XXH3_createState failed")
        self._reset[bits](state)
        return self._update[bits], state

    def digest(self, bits: int, state: int) -> int:
        value = self._digest[bits](state)
        return value if bits == 64 else value.high64 << 64 | value.low64


def _update_fn(lib: ctypes.CDLL, bits: int) -> ctypes._CFuncPtr:
    """The streaming update the package's one-shot digests run at: its ``_dispatch`` variant
    (built with xxh_x86dispatch) picks the widest vector code the CPU runs, the plain one is
    SSE2 (1 MiB: 31 µs against 12 µs here). Same digest."""
    try:
        return getattr(lib, f"XXH3_{bits}bits_update_dispatch")
    except AttributeError:
        return getattr(lib, f"XXH3_{bits}bits_update")


FP_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
             torch.int8: 4, torch.uint8: 5, torch.int16: 6, torch.int32: 7, torch.int64: 8,
             torch.bool: 9}
_FP_OUT = struct.Struct("<ddqqQQ")


class Fingerprinter:
    """``cc_fingerprint``: hash and summary of a small contiguous CPU tensor in one C call
    (the per-call cost of a collective's fingerprint is this call, not numpy's reductions).
    One output buffer and xxh3 state per calling thread (DDP hooks run on autograd's)."""

    def __init__(self, lib: ctypes.CDLL, xxh3: Xxh3) -> None:
        fn = lib.cc_fingerprint
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._fn = fn
        lib.cc_set_xxh3.argtypes = [ctypes.c_void_p] * 3
        lib.cc_set_xxh3(ctypes.cast(xxh3._reset[128], ctypes.c_void_p).value,
                        xxh3._update[128],
                        ctypes.cast(xxh3._digest[128], ctypes.c_void_p).value)
        self._xxh3 = xxh3
        self._local = threading.local()

    @staticmethod
    def code(t: torch.Tensor) -> int | None:
        """The kernel's dtype code for ``t``; None where it does not take it."""
        return FP_CODES.get(t.dtype)

    def __call__(self, t: torch.Tensor, code: int, hash: bool, summary: bool
                 ) -> tuple[tuple[int, int], tuple[float, float, int, int]]:
        """``t`` contiguous on the CPU, ``code`` from :meth:`code`."""
        local = self._local
        out = getattr(local, "out", None)
        if out is None:
            out = local.out = ctypes.create_string_buffer(48)
            state = self._xxh3.start(128)[1]
            local.state = state
        failed = self._fn(t.data_ptr(), t.numel(), t.numel() * t.element_size(), code,
                          hash, summary, local.state, out)
        if failed:
            raise RuntimeError(f"commcheck: cc_fingerprint failed ({failed})")
        s, m, nan, inf, h0, h1 = _FP_OUT.unpack(out.raw)
        return (h0, h1), (s, m, nan, inf)


@functools.cache
def fingerprinter() -> Fingerprinter | None:
    """The small-tensor fingerprint call, or None where the kernel or xxh3 is unavailable."""
    k = kernel()
    if k is None or k._xxh3 is None:
        return None
    try:
        return Fingerprinter(k._lib, k._xxh3)
    except (OSError, AttributeError) as exc:
        log.warning("commcheck: native fingerprints unavailable (%s)", exc)
        return None


@functools.cache
def kernel() -> Kernel | None:
    """The loaded kernel, or None (logged once) when it cannot be built or loaded here."""
    try:
        lib = installed_library()
        if lib is None:
            lib = load(_build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("commcheck: native CPU kernel unavailable (%s); using torch kernels", exc)
        return None
    return Kernel(lib, _load_xxh3())


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path``, opened as :func:`.private.opened` checks it."""
    with private.opened(path) as name:
        return ctypes.CDLL(name)


def source_key(paths: Iterable[Path]) -> str:
    """The key setup.py builds into each library (``CC_SOURCE_KEY``)."""
    return hashlib.sha256(b"\0".join(p.read_bytes() for p in paths)).hexdigest()[:20]


def installed_origin(name: str) -> Path | None:
    """The file of the extension ``commcheck.native.<name>`` built with the package."""
    spec = importlib.util.find_spec(f"{__package__}.{name}")
    return Path(spec.origin) if spec is not None and spec.origin else None


def current(origin: Path, built_key: str | None, sources: tuple[Path, ...]) -> bool:
    """Whether a library built with the package is of the sources beside it (always, where
    they are not shipped); a stale one is said once and not used."""
    here = [origin.with_name(s.name) for s in sources]
    if built_key is None or not all(p.exists() for p in here) or \
            built_key == source_key(here):
        return True
    log.warning("commcheck: %s was built from other sources than those beside it (rebuild: "
                "pip install -e .); building them now", origin.name)
    return False


def installed_library() -> ctypes.CDLL | None:
    """``commcheck.native._kernel`` where the package was built with it, else None."""
    origin = installed_origin("_kernel")
    if origin is None:
        return None
    try:
        lib = ctypes.CDLL(str(origin))
    except OSError as exc:
        log.warning("commcheck: %s cannot be loaded (%s); building the kernel now",
                    origin.name, exc)
        return None
    try:
        built = (ctypes.c_char * 21).in_dll(lib, "cc_source_key").value.decode()
    except ValueError:
        built = None
    return lib if current(origin, built, (SOURCE,)) else None


def _load_xxh3() -> Xxh3 | None:
    try:
        return Xxh3(ctypes.CDLL(xxhash._xxhash.__file__))
    except (OSError, AttributeError):
        return None


def _build(source: Path = SOURCE, flags: tuple[str, ...] = FLAGS,
           depends: tuple[Path, ...] = (), tag: str = "native", abi: bytes = b"") -> Path:
    """Path of the built library: the cached one, else compiled now (atomically renamed into
    place, so ranks of one node building at once are harmless) in the first private place
    :func:`.private.cache_dirs` gives. ``depends``: sources it includes; ``abi``: the
    interpreter an extension is built for (part of the key)."""
    found = _c_compiler()
    name = library_name(found, source, flags, depends, tag, abi)
    for cache in private.cache_dirs():
        try:
            return _compile_into(cache / name, found, source, flags)
        except OSError as exc:
            if exc.errno not in private.UNWRITABLE:
                raise
    raise OSError("no private directory to build the native code in")


def _c_compiler() -> str:
    compiler = os.environ.get("CC") or "cc"
    found = shutil.which(compiler)
    if found is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    return found


def library_name(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS,
                 depends: tuple[Path, ...] = (), tag: str = "native", abi: bytes = b"") -> str:
    """The first-use build's file name: a key of everything the library depends on."""
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(d.read_bytes() for d in depends),
                abi,
                compiler.encode(),
                compiler_version(compiler),
                platform.machine().encode(),
                " ".join(flags + OPENMP).encode(),
            ]
        )
    ).hexdigest()[:20]
    return f"{tag}-{key}.so"


def _usable(target: Path) -> bool:
    """Whether ``target`` is there and passes :func:`.private.opened`'s checks (a file that
    does not is refused, said once, and replaced: its directory is ours)."""
    try:
        with private.opened(target, keep=False):
            return True
    except FileNotFoundError:
        return False
    except private.Refused as exc:
        private.refuse(f"the native library {exc}; building a new one")
        return False


def _compile_into(target: Path, compiler: str, source: Path = SOURCE,
                  flags: tuple[str, ...] = FLAGS) -> Path:
    if _usable(target):
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (OPENMP, ()):
            done = subprocess.run(
                [compiler, *flags, *extra, "-o", tmp, str(source), "-lm"],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
            if done.returncode == 0:
                break
        else:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise OSError(f"{os.path.basename(compiler)} failed: {first}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cache_dir() -> Path:
    return private.default_cache()
