"""Hashes and cheap summaries of exactly the bytes a collective read or wrote.

CPU tensors are hashed with xxh3-128 over the raw bytes of the view, in logical element
order (DESIGN.md rule 3). Large float32 ones take hash and summary from one read, in the
native kernel (``native.py``); its float64 sums differ from torch's in the last bits only.
Device tensors use :func:`device_hash`, a position-aware multiply-xorshift fold written in
plain torch ops so it runs on any device without a host synchronisation (on a GPU with
Triton, ``device_fold`` computes the same bits and the summary in one kernel); its 48 result bytes
travel to pinned host memory behind a CUDA event that the sender thread polls
(:class:`DevicePrint`). The same function runs on CPU tensors, which is how the unit tests
pin down its properties without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ..native import loader as native
from . import device_fold

ALGO_XXH3 = "xxh3-128"
ALGO_DEVICE = "ccmix64x2-v1"

Summary = tuple[float, float, int, int]  # float64 sum, abs-max, NaN count, Inf count
ZERO_SUMMARY: Summary = (0.0, 0.0, 0, 0)

_MASK64 = (1 << 64) - 1
_BLOCK = 256  # float32 partial sums over 256 elements, then float64 across blocks


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of the tensor's elements in logical order (copies only if strided)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _split(h: int) -> tuple[int, int]:
    return h & _MASK64, (h >> 64) & _MASK64


def hash_cpu(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return _split(xxhash.xxh3_128_intdigest(b""))
    return _split(xxhash.xxh3_128_intdigest(raw_bytes(t).numpy()))


def _as_real(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.dtype.is_floating_point and t.element_size() == 1:  # fp8 has no arithmetic on CPU
        return t.to(torch.float32)
    return t


def _sum64(x: torch.Tensor) -> float:
    if not x.dtype.is_floating_point:
        return float(x.sum(dtype=torch.float64))
    if x.dtype != torch.float32 or x.numel() % _BLOCK:
        return float(x.sum(dtype=torch.float64))
    return float(x.reshape(-1, _BLOCK).sum(1).sum(dtype=torch.float64))


_SMALL = 1 << 16  # below this, numpy's per-call cost beats torch's kernel launches
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8}


def _summary_small(a: np.ndarray) -> Summary | None:
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf are data here, not errors
        s = float(np.add.reduce(a, dtype=np.float64))
    if not math.isfinite(s):
        return None
    return s, max(-float(a.min()), float(a.max())), 0, 0


def _host_kernel(x: torch.Tensor) -> native.Kernel | None:
    """The native kernel for a flat tensor it takes and numpy would not do cheaper."""
    if x.numel() <= _SMALL:
        return None
    kernel = native.kernel()
    return kernel if kernel is not None and kernel.accepts(x) else None


@functools.cache
def _cpu_share() -> int:
    """This rank's share of the CPUs it may run on: those in its affinity mask over the ranks
    on its node (``LOCAL_WORLD_SIZE``, set by torchrun and ``commcheck run``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, cpus // max(local, 1))


def host_threads() -> int:
    """Threads for one native pass: torch's intra-op count, never more than the rank's share
    of the CPUs. An OpenMP pass wider than that waits for threads the other ranks' work holds
    (4 ranks on 2 cores with 2 threads each: a 1 MiB all_reduce took 4.5x, one thread 1.25x;
    docs/decisions.md, "The 4-rank bench")."""
    return min(torch.get_num_threads(), _cpu_share())


def _finite_summary(got: native.HostStats) -> Summary | None:
    if not math.isfinite(got.sum):  # NaN or Inf somewhere: the torch path counts them
        return None
    return got.sum, max(-got.low, got.high), 0, 0


def summary_cpu(t: torch.Tensor) -> Summary:
    """(sum, abs-max, NaN count, Inf count); counts are only computed when the sum says so."""
    if t.numel() == 0:
        return ZERO_SUMMARY
    x = _as_real(t).reshape(-1)
    if x.numel() <= _SMALL and x.dtype in _NUMPY_DTYPES:
        quick = _summary_small(x.numpy())
        if quick is not None:
            return quick
    kernel = _host_kernel(x)
    if kernel is not None:
        quick = _finite_summary(kernel.stats(x, threads=host_threads())[0])
        if quick is not None:
            return quick
    return _summary_torch(x)


def _summary_torch(x: torch.Tensor) -> Summary:
    """The summary of a flat real tensor with torch kernels; the only path that counts NaN
    and Inf."""
    s = _sum64(x)
    if not x.dtype.is_floating_point or math.isfinite(s):
        lo, hi = torch.aminmax(x)
        return s, float(max(-float(lo), float(hi))), 0, 0
    nan = torch.isnan(x)
    inf = torch.isinf(x)
    finite = x.masked_fill(nan, 0)
    absmax = float(finite.abs().max())
    return s, absmax, int(nan.sum()), int(inf.sum())


# --- device fingerprint -------------------------------------------------------------------

_K_POS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_K_MUL = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_K_LEN = 0x165667B19E3779F9
_CHUNK_WORDS = 1 << 23  # bounds the temporaries to 64 MiB per lane


def _signed(k: int) -> int:
    return k - (1 << 64) if k >= 1 << 63 else k


def device_hash(t: torch.Tensor) -> torch.Tensor:
    """Two 64-bit lanes of sum_i mix(word_i ^ pos_i); int64 tensor of 2 on ``t``'s device.

    Each term is a bijection of its word, so any single change changes the sum; the
    position key makes a permutation change it too. Wrapping int64 arithmetic is
    deterministic on every backend.
    """
    b = raw_bytes(t)
    n = b.numel()
    pad = (-n) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    words = b.view(torch.int64)
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start:start + _CHUNK_WORDS]
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=t.device)
        for lane in range(2):
            y = (w ^ (pos * _signed(_K_POS[lane]))) * _signed(_K_MUL[lane])
            y = y ^ torch.bitwise_right_shift(y, 31).bitwise_and(0x1FFFFFFFF)
            acc[lane] += (y * _signed(_K_MUL[1 - lane])).sum()
    return acc ^ _signed((n * _K_LEN) & _MASK64)


def device_summary(t: torch.Tensor) -> torch.Tensor:
    """float64 tensor [sum, abs-max, NaN count, Inf count] computed where ``t`` lives."""
    if t.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=t.device)
    x = _as_real(t).reshape(-1)
    s = x.sum(dtype=torch.float64)
    if not x.dtype.is_floating_point:
        return torch.stack([s, x.abs().max().double(), s.new_zeros(()), s.new_zeros(())])
    nan = torch.isnan(x)
    inf = torch.isinf(x)
    absmax = x.masked_fill(nan, 0).abs().max().double()
    return torch.stack([s, absmax, nan.sum().double(), inf.sum().double()])


def _u64(v: int) -> int:
    return v & _MASK64


@dataclass
class DevicePrint:
    """Hash + summary of a device tensor, on its way to pinned host memory.

    Built on the training thread without synchronising: kernels and a non-blocking copy
    are enqueued on the current stream and an event is recorded after them. The sender
    thread calls :meth:`ready` (a non-blocking ``event.query()``) and then :meth:`values`.
    ``keep`` holds the device tensors until the copy has landed.
    """

    host: torch.Tensor
    event: object
    keep: tuple

    @classmethod
    def start(cls, t: torch.Tensor) -> DevicePrint:
        packed = device_fold.fold(t)  # one Triton launch where it can, the same bits
        if packed is None:
            packed = torch.cat([device_hash(t), device_summary(t).view(torch.int64)])
        host = torch.empty(6, dtype=torch.int64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, (packed,))

    def ready(self) -> bool:
        return bool(self.event.query())

    def values(self) -> tuple[tuple[int, int], Summary]:
        v = self.host.tolist()
        s = self.host[2:].view(torch.float64).tolist()
        return (_u64(v[0]), _u64(v[1])), (s[0], s[1], int(s[2]), int(s[3]))


# _ONE_THREAD: on one thread a large float32 tensor takes the small tensors' call too: its
# pieces' sums (AVX-512 where the CPU has it, no sum of squares) each hashed from L1 right
# after, with xxhash's dispatching stream. On this box, µs: 1 MiB 31, 4 MiB 120, 16 MiB 500,
# against 43, 137, 560 for the statistics kernel and xxh3 in one shot after it. Same bits.
# The sums alone (a reduction's input): 1 MiB 19 µs against the statistics kernel's 26 (it
# also sums squares, and is called through ctypes); 31 against 50 with four ranks busy.

_native_small: native.Fingerprinter | None | bool = False  # False: not looked up yet


def _small_kernel() -> native.Fingerprinter | None:
    global _native_small
    if _native_small is False:
        _native_small = native.fingerprinter()
    return _native_small  # type: ignore[return-value]


def fingerprint_cpu(t: torch.Tensor, hash: bool, summary: bool) -> tuple[tuple[int, int], Summary]:
    """:func:`hash_cpu` and :func:`summary_cpu` (each only if asked; else zeros): one native
    call for a small contiguous tensor of a common dtype (or a large one's hash alone), one
    read of a large float32 tensor when the native kernel takes it, else numpy/torch."""
    fp = _native_small if _native_small is not False else _small_kernel()
    if (t.numel() <= _SMALL or not summary) and t.is_contiguous() and not t.is_neg():
        code = native.FP_CODES.get(t.dtype)
        if fp is not None and code is not None:  # a large one's hash alone: no numpy view
            return fp(t, code, hash, summary)  # type: ignore[operator]
    if summary and t.dtype == torch.float32:
        x = t.reshape(-1)  # a contiguous copy if strided, as raw_bytes makes for the hash
        kernel = _host_kernel(x)
        threads = host_threads() if kernel is not None else 0
        if threads == 1 and fp is not None:  # see _ONE_THREAD
            return fp(x, native.FP_CODES[torch.float32], hash, True)  # type: ignore[operator]
        if hash and kernel is not None:  # the hash on a thread of its own beside the sums
            got, digest = kernel.stats(x, threads=threads, hash_bits=128)
            assert digest is not None
            return _split(digest), _finite_summary(got) or _summary_torch(x)
    return (hash_cpu(t) if hash else (0, 0)), (summary_cpu(t) if summary else ZERO_SUMMARY)


def algo_for(t: torch.Tensor) -> str:
    return ALGO_XXH3 if t.device.type == "cpu" else ALGO_DEVICE
