"""Ranks that freeze, abort or crash, as users meet them (issue 12). ``DYING`` picks one:

* ``stop``: at iteration ``AT`` (default 4) rank ``VICTIM`` (default 1) enters the
  all_reduce first and stops itself (SIGSTOP) 0.5 s later, inside it; the others enter 1 s
  late, so every member entered and none can complete: the shape of a real NCCL hang. The
  test ends the job.
* ``abort``: at iteration ``AT`` rank ``VICTIM`` calls all_reduce with 999 elements where
  the others use 1000, then aborts (SIGABRT, as gloo does on a size mismatch; gloo's own
  check is not relied on). The others' all_reduce fails on the broken connection.
* ``crash``: every rank raises right after ``init_process_group``: no collective at all.
* ``kill``: at iteration ``AT`` the others enter the all_reduce while rank ``VICTIM``
  SIGKILLs itself 0.5 s later without entering: the survivors' all_reduce fails on the
  closed connection (gloo's "Connection closed by peer"), which they print and exit on.

``BACKEND=nccl`` runs it on one GPU per rank (``launch/tools/gpu_check.py``'s frozen-rank case).
"""

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODE = os.environ.get("DYING", "stop")
VICTIM = int(os.environ.get("VICTIM", "1"))
AT = int(os.environ.get("AT", "4"))
ITERS = int(os.environ.get("ITERS", "8"))
BACKEND = os.environ.get("BACKEND", "gloo")


def stop_me_in(seconds: float) -> None:
    def stop() -> None:
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=stop, daemon=True).start()


def main() -> int:
    device = torch.device("cpu")
    if BACKEND == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if MODE == "crash":
        raise RuntimeError(f"rank {rank}: bad config, giving up before training")
    x = torch.ones(1000, device=device)
    for i in range(ITERS):
        n = 1000
        if i == AT and MODE == "stop":
            if rank == VICTIM:
                stop_me_in(0.5)
            else:
                time.sleep(1.0)
        if i == AT and MODE == "kill" and rank == VICTIM:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        if i == AT and MODE == "abort" and rank == VICTIM:
            n = 999
            threading.Timer(0.5, os.abort).start()
        try:
            dist.all_reduce(x[:n])  # CALL:ar
            if BACKEND == "nccl":
                torch.cuda.synchronize(device)  # NCCL returns at once; block in the collective
        except Exception as e:
            print(f"rank {rank}: collective failed: {type(e).__name__}: {e}", flush=True)
            return 1
        commcheck.step()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
