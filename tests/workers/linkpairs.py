"""Exchanges between every pair of hosts, for the slow-link test (one rank per node).

Each step: ``PAIRS_COMPUTE`` s of sleep ("compute"), then ``PAIRS_CALLS`` rounds; in a round
every rank all-reduces ``PAIRS_NUMEL`` floats in each of its 2-rank groups, all started at
once (``async_op``), and waits for them. A rank leaves a round once its slowest exchange is
done, so the members of each exchange enter the next round together and a slow link shows
as a long transfer, not as a late rank. At the start of step ``PAIRS_SLOW_AT`` rank
``PAIRS_SLOW_RANK`` runs the shell command ``PAIRS_SLOW_CMD`` (the test's ``tc`` rate limit
on its node's link) and writes the wall time to ``PAIRS_MARK``/onset.
"""

import itertools
import os
import subprocess
import time
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = int(os.environ.get("PAIRS_STEPS", "40"))
CALLS = int(os.environ.get("PAIRS_CALLS", "4"))
NUMEL = int(os.environ.get("PAIRS_NUMEL", str(4 * 1024)))
COMPUTE = float(os.environ.get("PAIRS_COMPUTE", "0.05"))
SLOW_AT = int(os.environ.get("PAIRS_SLOW_AT", "-1"))
SLOW_RANK = int(os.environ.get("PAIRS_SLOW_RANK", "-1"))
SLOW_CMD = os.environ.get("PAIRS_SLOW_CMD", "")
MARK = os.environ.get("PAIRS_MARK", "")


def slow_down() -> None:
    subprocess.run(SLOW_CMD, shell=True, check=True, timeout=20)
    if MARK:
        with open(os.path.join(MARK, "onset"), "w") as f:
            f.write(repr(time.time()))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = list(itertools.combinations(range(world), 2))
    groups = {p: dist.new_group(list(p)) for p in pairs}  # every rank makes every group
    mine = {p: torch.ones(NUMEL) for p in pairs if rank in p}
    for step in range(STEPS):
        if step == SLOW_AT and rank == SLOW_RANK:
            slow_down()
        time.sleep(COMPUTE)
        for _ in range(CALLS):
            works = [dist.all_reduce(x, group=groups[p], async_op=True) for p, x in mine.items()]
            for w in works:
                w.wait()
            for x in mine.values():
                x.fill_(1.0)
        commcheck.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
