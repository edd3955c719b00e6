"""What the framework workers (fw_*.py) share: patch or not, watch or not, print losses.

Env: FW_PATCH=0 runs the job unpatched (commcheck is not even imported), the reference
for bit-identical losses; COMMCHECK_TEST_WATCH=1 also calls ``commcheck.watch`` on the DDP
model the framework built (otherwise DDP's buckets are seen only if ``patch()`` alone
covers DDP).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PATCHED = os.environ.get("FW_PATCH", "1") != "0"


def patch() -> None:
    """``commcheck.patch()`` before the framework is imported, as the README says."""
    if PATCHED:
        import commcheck

        commcheck.patch()


def watch(model: object) -> None:
    if PATCHED and os.environ.get("COMMCHECK_TEST_WATCH") == "1":
        import commcheck

        commcheck.watch(model)


def loss(rank: int, step: int, value: float) -> None:
    """One line per rank and step, the value exact (``float.hex``), for the test to compare."""
    sys.stdout.write(f"LOSS {rank} {step} {float(value).hex()}\n")  # one write: ranks share
    sys.stdout.flush()


def teardown() -> None:
    """Destroy the process group the framework left to interpreter exit, as PyTorch asks,
    then end the process after the exit handlers (commcheck's goodbye among them) and
    before C++'s static destructors. Even torn down, gloo's threads sometimes abort the
    process at finalization ("terminate called without an active exception", SIGABRT;
    pytorch/pytorch#190489), patched or not: seen in accelerate's unpatched run twice, the
    second time after ``end_training`` and this teardown. What is under test ends before."""
    import atexit

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
