"""Compiled training as large jobs run it, 4 ranks, ``WORKER_STEPS`` steps per part
(default 4); each part trained first unpatched, then (after ``commcheck.patch()``) again
from the same start, in one process:

* ``fsdp_tp``: a 2-D mesh, FSDP2 (``fully_shard`` on ``dp``) × TP (``tp``), each block
  compiled with ``block.compile()`` and one deliberate graph break in it. ``ColwiseParallel``
  → ``RowwiseParallel`` ends each block's forward in a compiled TP all-reduce (and the
  second block's backward in another). FSDP2 all-gathers each block's parameters before
  its forward and again before its backward, and reduce-scatters its gradients: in torch
  2.13 FSDP2's hooks are ``torch._dynamo.disable``d, so those run eagerly, outside the
  graphs, through ``dist.*`` (commcheck's eager wrappers). Sequence parallelism, which would
  put an all-gather and a reduce-scatter inside the graph, fails in Dynamo on this 2-D mesh
  in torch 2.13, unpatched (docs/compiled.md).
* ``ddp``: DDP + ``torch.compile`` with torch's default DDP optimizer, three gradient
  buckets (``bucket_cap_mb=1``, DDP's first-bucket size: smaller trips the DDP optimizer's
  own assertion).
* ``ca``: DDP under compiled autograd (``optimize_ddp="python_reducer"``, a compiled train
  step calling ``backward``): the Python reducer's bucket all-reduces are traced into the
  compiled backward graph.

Models built before ``patch()`` are the unpatched ones; DDP models for the patched run are
built after it (commcheck's comm hook goes on at construction). Every rank writes
``$WORKER_OUT/result<rank>.json``: per part and run, losses (hex), graph breaks, graphs,
and for the DDP parts the collectives the backend ran during each ``backward``.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import commcheck

STEPS = int(os.environ.get("WORKER_STEPS", "4"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))  # CALL:up
        torch._dynamo.graph_break()  # two graphs per block: patching must not change that
        return x + self.down(h)  # CALL:down


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)  # CALL:fsdp
        return x


def fsdp_tp(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def ddp(python_reducer: bool = False) -> DDP:
    torch._dynamo.config.optimize_ddp = "python_reducer" if python_reducer else True
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 1024), nn.ReLU(),
                        nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 4))
    return DDP(mlp, bucket_cap_mb=1)


def _sequence() -> int:
    return dist.group.WORLD._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


def _begin() -> None:
    torch._dynamo.reset()
    counters.clear()


def _end(losses: list[str], **more) -> dict:
    breaks = counters["graph_break"]
    return {"losses": losses, "graph_breaks": sum(breaks.values()),
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": [f"{n}× {r.splitlines()[0]}: {r.splitlines()[1:2]}"
                       for r, n in breaks.items()], **more}


def train_fsdp_tp(model, dp: int) -> dict:
    _begin()
    for block in model.blocks:
        block.compile()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * dp + step))
        loss = model(x).pow(2).mean()
        loss.backward()  # CALL:backward
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    return _end(losses)


def train_ddp(model: DDP, compiled_autograd: bool = False) -> dict:
    _begin()
    torch._dynamo.config.compiled_autograd = compiled_autograd
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())

    @torch.compile
    def step_ca(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    def step_eager_backward(x):
        loss = compiled(x).pow(2).mean()
        before = _sequence()
        loss.backward()
        return loss, before

    losses, backward = [], []
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=gen)
        if compiled_autograd:
            before = _sequence()
            loss = step_ca(x)
        else:
            loss, before = step_eager_backward(x)
        backward.append(_sequence() - before)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    if compiled_autograd:
        # a Python-reducer DDP adds DDP's module to Dynamo's inline list for good: undone,
        # so that the next DDP-optimizer part traces DDP as the first one did
        rules = torch._dynamo.trace_rules
        rules.LEGACY_MOD_INLINELIST.discard("torch.nn.parallel.distributed")
        rules.get_legacy_mod_inlinelist.cache_clear()
    return _end(losses, backward=backward)


def train(part: str, mesh, built: nn.Module | None) -> dict:
    """One part, on a model built now (or before ``patch()``: ``built``)."""
    if part == "fsdp_tp":
        return train_fsdp_tp(built or fsdp_tp(mesh), mesh["dp"].get_local_rank())
    return train_ddp(ddp(python_reducer=part == "ca"), compiled_autograd=part == "ca")


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parts = os.environ.get("WORKER_PARTS", "fsdp_tp,ddp,ca").split(",")
    plain = {p: train(p, mesh, built=None) for p in parts}
    built = fsdp_tp(mesh) if "fsdp_tp" in parts else None
    assert commcheck.patch()
    checked = {p: train(p, mesh, built) for p in parts}
    out = Path(os.environ["WORKER_OUT"]) / f"result{dist.get_rank()}.json"
    out.write_text(json.dumps({"rank": dist.get_rank(), "plain": plain, "checked": checked}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
