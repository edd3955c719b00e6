"""A small training-like loop for the detector tests: desync, hang and NaN onset.

The fault itself comes from ``COMMCHECK_INJECT`` (``shape``, ``skip``, ``nan`` on
``all_reduce``, see commcheck/rank/inject.py); this worker only makes the scenario end:

* ``FAULT_TIMEOUT`` (s, default 20): gloo timeout, so a mismatched or missing collective
  turns into an error on the waiting ranks instead of a hang forever;
* ``FAULT_HOLD_RANK`` / ``FAULT_HOLD`` (s): after its loop, that rank (the one that skipped)
  stays alive for FAULT_HOLD seconds without joining, like a stuck rank, then exits cleanly;
* ``FAULT_SHIM`` (``dist`` or ``both``): before ``patch()``, replace ``all_reduce`` and
  ``all_gather`` on ``torch.distributed`` (and ``distributed_c10d``) by a
  ``(*args, **kwargs)`` shim, as logging or profiling layers do; a comma list gives each
  node its own (``dist,both``: node 0 ``dist``, node 1 ``both``);
* ``FAULT_ITERS`` (default 8): iterations; each does one all_reduce (``# CALL:ar``) whose
  output feeds the next input (so a NaN propagates) and one all_gather (``# CALL:ag``).

Ranks whose collective failed exit with status 1 after commcheck delivered its records.
"""

import os
import sys
import time
from datetime import timedelta

import commcheck

_SHIMS = os.environ.get("FAULT_SHIM", "").split(",")
SHIM = _SHIMS[int(os.environ.get("GROUP_RANK", "0")) % len(_SHIMS)]
if SHIM:  # a logging shim without functools.wraps, before patch()
    import torch.distributed as _dist
    import torch.distributed.distributed_c10d as _c10d

    def _shim(real):
        def shim(*args, **kwargs):
            return real(*args, **kwargs)
        return shim

    for _name in ("all_reduce", "all_gather"):
        _fn = _shim(getattr(_dist, _name))
        setattr(_dist, _name, _fn)
        if SHIM == "both":
            setattr(_c10d, _name, _fn)

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ITERS = int(os.environ.get("FAULT_ITERS", "8"))
TIMEOUT = float(os.environ.get("FAULT_TIMEOUT", "20"))
HOLD_RANK = int(os.environ.get("FAULT_HOLD_RANK", "-1"))
HOLD = float(os.environ.get("FAULT_HOLD", "0"))


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    state = torch.zeros(256)
    try:
        for _ in range(ITERS):
            x = state + torch.randn(256, generator=g)
            dist.all_reduce(x)  # CALL:ar
            state = x / world
            parts = [torch.empty(16) for _ in range(world)]
            dist.all_gather(parts, state[:16].clone())  # CALL:ag
            commcheck.step()
    except Exception as e:  # the waiting side of a desync or a hang
        print(f"rank {rank}: collective failed: {type(e).__name__}: {e}", flush=True)
        commcheck.unpatch()  # deliver what was recorded before exiting
        return 1
    if rank == HOLD_RANK:
        time.sleep(HOLD)
        commcheck.unpatch()
        return 0
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
