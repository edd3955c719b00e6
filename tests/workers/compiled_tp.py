"""A tensor-parallel MLP (``ColwiseParallel`` then ``RowwiseParallel`` on a 1-D CPU mesh)
under ``torch.compile``, ``WORKER_STEPS`` steps (default 6): each forward ends in one
all-reduce that Inductor's code issues (``_c10d_functional.all_reduce_``), in the second of
two graphs (one deliberate graph break).

``WORKER_PLAIN=1``: first the same training unpatched, then ``torch._dynamo.reset()`` and
again patched; rank 0 prints ``RESULT {json}`` with both runs' losses (hex), graph-break
counts and graphs compiled, so the test can say patching changed nothing. Otherwise only the
patched run. Both models are built (and their parameters distributed, which DTensor does
with ``scatter``/``broadcast`` bound at its import) before ``commcheck.patch()``: after it,
every collective of the job is one that Inductor's code issues.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import commcheck

STEPS = int(os.environ.get("WORKER_STEPS", "6"))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        torch._dynamo.graph_break()  # two graphs: the count patching must not change
        return self.down(h)  # CALL:down


def build(mesh) -> nn.Module:
    torch.manual_seed(0)
    return parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def train(model) -> dict:
    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    return {"losses": losses, "seconds": time.perf_counter() - t0,
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain = build(mesh) if os.environ.get("WORKER_PLAIN") == "1" else None
    model = build(mesh)
    plain = train(plain) if plain is not None else None
    assert commcheck.patch()
    checked = train(model)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"plain": plain, "checked": checked}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
