"""The device fingerprint of a GPU tensor in one Triton kernel: hash lanes and summary from
one read, written as the six int64 words :class:`fingerprint.DevicePrint` carries.

Why: :func:`fingerprint.device_hash` and :func:`fingerprint.device_summary` are ~36 torch
ops, each a kernel launch of 7-11 µs on the training thread: 480 µs a tensor, ~1.3 ms a
patched NCCL all_reduce whose own call costs 20 µs (H200 host, docs/performance.md). This
kernel computes the very same hash bits (``ccmix64x2-v1``: the fold is integer arithmetic,
exact in any order) and the summary (float64 sum in a fixed order per launch shape, so
ranks that hold the same bytes agree bit for bit) in one launch, or two for tensors above
``_ONE_PROGRAM_WORDS`` (per-program partials, then one program folds them in order).

Taken for contiguous float tensors whose bytes are whole, 8-byte aligned int64 words; any
other tensor, a machine without Triton, a Triton cache another user could write, or
``COMMCHECK_TRITON=0`` takes the torch ops, which give the same hash. The kernels are
compiled on a thread of their own at the first device tensor of each dtype, into Triton's
cache (once per node); calls meanwhile take the torch ops.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from ..native import private

log = logging.getLogger("commcheck")

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ONE_PROGRAM_WORDS = 1 << 16  # up to 512 KiB: one program, one launch, the final words
_WORDS = _ELEMS = 1024  # words (elements) a program folds per step
_PROGRAMS = 1024  # most programs of a large tensor (partials folded by one program)

_kernels: tuple | None | bool = False  # False: not looked up yet; None: no Triton


def triton_cache() -> Path:
    """Where Triton keeps what it compiled, and loads from (its launcher is a library)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _build() -> tuple | None:
    if os.environ.get("COMMCHECK_TRITON", "1") == "0":
        return None
    try:
        import triton  # noqa: F401
    except Exception:  # no Triton (a CPU build of torch, or not installed): the torch ops
        return None
    try:  # a cache another user can write is their code in every rank (docs/security.md)
        private.ensure_dir(triton_cache())
    except OSError as exc:
        private.refuse(f"Triton's cache for the device fingerprint ({exc}); the torch ops "
                       f"fingerprint device tensors instead")
        return None
    from . import triton_fold

    return triton_fold.fold, triton_fold.combine


def kernels() -> tuple | None:
    global _kernels
    if _kernels is False:
        _kernels = _build()
    return _kernels  # type: ignore[return-value]


def _signed(k: int) -> int:
    k &= (1 << 64) - 1
    return k - (1 << 64) if k >= 1 << 63 else k


def fold(t: torch.Tensor) -> torch.Tensor | None:
    """int64[6] on ``t``'s device: hash lanes, then float64 sum, abs-max (NaN left out), NaN
    and Inf counts as their bits (device_summary's words); None where the torch ops must do
    it, which they also do while this dtype's kernels are compiled, on a thread of their
    own, the first time a tensor of it comes: training never waits for a compiler."""
    if t.device.type != "cuda" or t.dtype not in _DTYPES or not t.is_contiguous() or \
            t.numel() == 0:
        return None  # other devices (XLA, HPU, MPS): the torch ops, which run anywhere
    if t.numel() * t.element_size() % 8 or t.data_ptr() % 8:
        return None
    key = (t.device, t.dtype)
    if key in _ready:
        if not _compiling.acquire(blocking=False):  # another dtype's build holds Triton
            return None
        try:
            return launch(t, _ready[key])
        finally:
            _compiling.release()
    if key not in _warming:
        _warming.add(key)
        threading.Thread(target=_warm_up, args=key, name="commcheck-triton-build",
                         daemon=True).start()
    return None


_ready: dict[tuple[torch.device, torch.dtype], tuple] = {}
_warming: set[tuple[torch.device, torch.dtype]] = set()
_compiling = threading.Lock()  # Triton's compiler is not for two threads at once


def ready() -> bool:
    """Whether the kernels were built for some device and dtype (benchmarks wait for it)."""
    return bool(_ready)


def _warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Compile and run every variant a tensor of ``dtype`` can take (one program and many;
    16-byte aligned and not) on a side stream; ready only if all of them ran."""
    found = kernels()
    if found is None:
        return
    try:
        with _compiling, torch.cuda.device(device):
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                step = 8 // torch.empty(0, dtype=dtype).element_size()
                for words in (64, _ONE_PROGRAM_WORDS + 64):
                    base = torch.zeros(words * step + step, dtype=dtype, device=device)
                    launch(base[:-step], found)
                    launch(base[step:], found)
            side.synchronize()
    except Exception as exc:  # a kernel that cannot build or run here: the torch ops, for good
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        log.warning("commcheck: the Triton device fingerprint cannot be built for %s on %s "
                    "(%s); the torch ops fingerprint those tensors (slower)",
                    str(dtype).removeprefix("torch."), device, why)
        return
    _ready[(device, dtype)] = found


def launch(t: torch.Tensor, found: tuple) -> torch.Tensor:
    """:func:`fold`'s kernels on ``t`` (checked by it), enqueued on the current stream."""
    fold_kernel, combine_kernel = found
    x = t.reshape(-1)
    words = x.view(torch.int64)
    n_words = words.numel()
    len_key = _signed(n_words * 8 * 0x165667B19E3779F9)
    out = torch.empty(6, dtype=torch.int64, device=t.device)
    if n_words <= _ONE_PROGRAM_WORDS:
        fold_kernel[(1,)](x, words, out, n_words, x.numel(), len_key, ELEMS=_ELEMS, WORDS=_WORDS)
        return out
    programs = min(_PROGRAMS, -(-n_words // _WORDS))
    parts = torch.empty(programs * 6, dtype=torch.int64, device=t.device)
    fold_kernel[(programs,)](x, words, parts, n_words, x.numel(), 0, ELEMS=_ELEMS, WORDS=_WORDS)
    combine_kernel[(1,)](parts, out, programs, len_key, PARTS=_PROGRAMS)
    return out
