"""A short all_reduce loop for the launcher tests; LAUNCH_FAIL="kill:R" or "exit:R" makes
global rank R die by SIGKILL (no goodbye) or exit with status 3 (goodbye at exit) mid-run."""

import os
import signal
import sys
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = 30
FAIL_AT = 10


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    how, _, victim = os.environ.get("LAUNCH_FAIL", "").partition(":")
    for step in range(STEPS):
        if how and step == FAIL_AT and rank == int(victim):
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            sys.exit(3)
        x = torch.full((256,), float(rank + step))
        dist.all_reduce(x)
        commcheck.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
