"""A short DDP training loop under ``patch()``, for the DDP-by-default tests.

Env: DDP_MODE picks how the model is set up: ``plain`` (no watch(), no hook), ``hook_watch``
(the user's hook registered, then ``commcheck.watch``), ``watch_hook`` (the other order),
``fp16`` (the built-in FP16_COMPRESS hook); a comma list gives each node its own
(``hook_watch,watch_hook``: node 0 one order, node 1 the other). DDP_UNUSED=1:
find_unused_parameters=True with a branch each rank leaves unused in turn.
FLIP="rank:step[,rank:step...]": the user's hook flips bit 30 of its bucket's first element
on that rank at that step. STEPS (default 5). After two warm-up
steps (bucket rebuild), rank 0 prints ``MEASURED <n>``: the collectives its backend ran
during the remaining steps.
"""

import os
from datetime import timedelta

import commcheck

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

_MODES = os.environ.get("DDP_MODE", "plain").split(",")
MODE = _MODES[int(os.environ.get("GROUP_RANK", "0")) % len(_MODES)]
UNUSED = os.environ.get("DDP_UNUSED") == "1"
STEPS = int(os.environ.get("STEPS", "5"))
FLIPS = {tuple(int(x) for x in f.split(":")) for f in os.environ.get("FLIP", "").split(",") if f}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)  # buffers: DDP broadcasts them every step
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)
        self.side = torch.nn.Linear(32, 4) if UNUSED else None
        self.step = 0

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.norm(self.a(x)))))
        if UNUSED and self.step % 2:
            return self.side(h)
        return self.c(h)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    state = {"step": 0}

    def user_hook(process_group, bucket):
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()),
                              async_op=True).get_future()

        def done(f):
            out = f.value()[0]
            if (rank, state["step"]) in FLIPS and bucket.index() == 0:
                out.view(torch.int32)[0] ^= 1 << 30
            return out

        return fut.then(done)

    torch.manual_seed(0)
    net = Net()
    model = DDP(net, bucket_cap_mb=0.002, find_unused_parameters=UNUSED)
    if MODE == "hook_watch":
        model.register_comm_hook(None, user_hook)
        assert commcheck.watch(model)
    elif MODE == "watch_hook":
        assert commcheck.watch(model)
        model.register_comm_hook(None, user_hook)
    elif MODE == "fp16":
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(10 + rank)
    backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
    start = None
    for step in range(STEPS):
        if step == 2:
            start = backend._get_sequence_number_for_group()
        state["step"] = net.step = step
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).square().mean().backward()  # CALL:backward
        opt.step()
    if rank == 0:
        print(f"MEASURED {backend._get_sequence_number_for_group() - start}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
