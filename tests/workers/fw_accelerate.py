"""Hugging Face Accelerate on CPU under torchrun (2 ranks): a plain loop with
``Accelerator()``, a small MLP wrapped in DDP by ``prepare``, 4 steps, and
``gather_for_metrics`` of the predictions each step (an all_gather), as users write it.
``FW_COMM_HOOK=fp16``: the gradients reduced by Accelerate's FP16 comm hook (torch's
``fp16_compress_hook``), as ``DistributedDataParallelKwargs(comm_hook=...)`` asks."""

import os

import fw_common

fw_common.patch()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import (  # noqa: E402
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    set_seed,
)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def main() -> None:
    handlers = []
    if os.environ.get("FW_COMM_HOOK") == "fp16":
        handlers.append(DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16))
    accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
    set_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen))
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=8))
    fw_common.watch(model)
    for step, (x, y) in enumerate(loader):
        pred = model(x)
        loss = F.mse_loss(pred, y)
        accelerator.backward(loss)  # CALL:bucket
        opt.step()
        opt.zero_grad()
        accelerator.gather_for_metrics(pred.detach())  # CALL:gather
        fw_common.loss(accelerator.process_index, step, loss.item())
    # both ranks reach the process group's teardown together: one tearing it down while its
    # peer still sends made gloo abort at exit now and then, patched or not
    accelerator.wait_for_everyone()
    accelerator.end_training()
    fw_common.teardown()


if __name__ == "__main__":
    main()
