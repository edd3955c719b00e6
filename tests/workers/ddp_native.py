"""Two equal nanoGPT-shaped DDP models trained side by side under ``patch()``, one on each
of commcheck's DDP hooks: C++ (``native``) and Python (``python``, built with
``COMMCHECK_DDP_NATIVE=0``). Two buckets each, one above the small-tensor cut of 64 K
floats. ``NAN_AT="model:rank:step"``: that model's loss on that rank is NaN at that step,
so its buckets carry NaN into the all-reduce. STEPS (default 4). Each rank prints
``NATIVE <n> <m>``: the buckets each model's C++ hook recorded (-1: the Python hook)."""

import os
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

STEPS = int(os.environ.get("STEPS", "4"))
NAN_AT = os.environ.get("NAN_AT", "::").split(":")


def model() -> DDP:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 8))
    return DDP(net, bucket_cap_mb=0.2)


def loss(m: DDP, x: torch.Tensor, nan: bool) -> torch.Tensor:
    out = m(x).square().mean()
    return out * float("nan") if nan else out


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    native = model()
    os.environ["COMMCHECK_DDP_NATIVE"] = "0"
    python = model()
    del os.environ["COMMCHECK_DDP_NATIVE"]
    opt = torch.optim.SGD([*native.parameters(), *python.parameters()], lr=0.01)
    gen = torch.Generator().manual_seed(10 + rank)
    for i in range(STEPS):
        x = torch.randn(16, 64, generator=gen)
        poisoned = [name == NAN_AT[0] and f"{rank}:{i}" == ":".join(NAN_AT[1:])
                    for name in ("native", "python")]
        opt.zero_grad()
        loss(native, x, poisoned[0]).backward()  # CALL:native
        loss(python, x, poisoned[1]).backward()  # CALL:python
        opt.step()  # one optimizer: commcheck's step counts its steps
    counts = [m._commcheck_slot.native.buckets if m._commcheck_slot.native is not None else -1
              for m in (native, python)]
    print(f"NATIVE {counts[0]} {counts[1]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
