"""DDP training with the gradient probe's live cross-replica check.

Env: GRAD_PERTURB="rank:step:param" adds 1.0 to one element of that parameter's gradient
on that rank after DDP's reduction (a replica gone wrong); GRAD_NAN="rank:step:param" puts
a NaN there instead. DUMP is the probe's dump_path.
"""

import os
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def fault(name: str) -> tuple[int, int, str] | None:
    spec = os.environ.get(name)
    if not spec:
        return None
    rank, step, param = spec.split(":")
    return int(rank), int(step), param


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    probe = commcheck.GradProbe(model, level="L0", dump_path=os.environ["DUMP"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    perturb, nan = fault("GRAD_PERTURB"), fault("GRAD_NAN")
    params = dict(model.named_parameters())
    for step in range(8):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for f, value in ((perturb, None), (nan, float("nan"))):
            if f and f[0] == rank and f[1] == step:
                g = params[f[2]].grad.view(-1)
                g[0] = value if value is not None else g[0] + 1.0
        opt.step()
    probe.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
