"""Issue 16 item 6: ``torch.save(ddp_model)`` (upstream's test_DistributedDataParallelCPU)
works under ``patch()`` as without it, with and without a user comm hook, and the model
loaded back is watched."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import commcheck
from commcheck.rank.runtime import active_session

from .test_patch import _init, patched  # noqa: F401  (patched: the fixture)

pytestmark = pytest.mark.timeout(60)


def _round_trip(hook) -> tuple[DDP, torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    if hook is not None:
        model.register_comm_hook(None, hook)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded(torch.ones(3, 4)).sum().backward()
    return loaded, loaded.module.weight.grad.clone()


@pytest.mark.parametrize("hook", [None, allreduce_hook], ids=["default", "user_hook"])
def test_a_ddp_model_pickles_as_unpatched_and_is_watched_once_loaded(patched, hook):  # noqa: F811
    _init()
    loaded, grad = _round_trip(hook)
    assert [h for h, _ in loaded._comm_hooks] == ([] if hook is None else [allreduce_hook])
    assert getattr(loaded, "_commcheck_slot", None) is not None  # watched, not bypassed
    session = active_session()
    assert session is not None and session.not_checked == 0
    commcheck.unpatch()
    _, unpatched_grad = _round_trip(hook)
    assert torch.equal(grad, unpatched_grad)
    dist.destroy_process_group()
