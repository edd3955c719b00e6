"""Collectives asked for by a framework: ``fakefw`` (installed by the test in a
site-packages directory on PYTHONPATH) calls ``dist.all_reduce`` for this script."""

from datetime import timedelta

import commcheck

commcheck.patch()

import fakefw.dist  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for i in range(3):
        fakefw.dist.sync(torch.arange(16, dtype=torch.float32) * (dist.get_rank() + i))  # CALL:sync
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
