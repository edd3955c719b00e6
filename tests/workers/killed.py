"""Rank ``KILL_RANK`` (default 2) is SIGKILLed right after its ``KILL_AT``-th all_reduce
returned (default 7), as the OOM killer would: no exit handler, no goodbye. Every call
before it, and that one, wrote an entry and a completion record into the rank's ring; the
relay must deliver all of them. The other ranks then block in the next all_reduce until
torchrun stops them; with ``OTHERS_SLEEP`` they sleep that long first (a forward pass the
failure interrupts), and torchrun's SIGTERM reaches them there. ``PY_SIGTERM=exit``: after
the first all_reduce (the ring exists) each rank sets a Python SIGTERM handler that ends the
process without Python's exit path, as a framework's handler (or torchrun's SIGKILL after a
handler that only notes the signal, Lightning's) does; a second passes before the others;
``PY_SIGTERM=exit:1,3``: only on those ranks (the others keep the default handler)."""

import os
import signal
import time
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

KILL_RANK = int(os.environ.get("KILL_RANK", "2"))
KILL_AT = int(os.environ.get("KILL_AT", "7"))
OTHERS_SLEEP = float(os.environ.get("OTHERS_SLEEP", "0"))
_HANDLER, _, _ON = os.environ.get("PY_SIGTERM", "").partition(":")


def py_sigterm(rank: int) -> bool:
    return _HANDLER == "exit" and (not _ON or str(rank) in _ON.split(","))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    for i in range(1, KILL_AT + 2):
        dist.all_reduce(torch.full((1024,), float(i)))
        if i == 1 and py_sigterm(rank):
            signal.signal(signal.SIGTERM, lambda sig, frame: os._exit(128 + sig))
            time.sleep(1.5)  # the resolver puts commcheck's mark back in front within 1 s
        if rank == KILL_RANK and i == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == KILL_AT:
            time.sleep(OTHERS_SLEEP)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
