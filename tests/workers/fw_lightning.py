"""PyTorch Lightning, ``strategy="ddp"`` on CPU under torchrun (2 ranks): a small MLP, 4
steps, ``self.log(..., sync_dist=True)`` (an all_reduce a step) and ``self.all_gather``
of the loss (a barrier and an all_gather a step), as users write them."""

import fw_common

fw_common.patch()

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        self.all_gather(loss.detach())  # CALL:gather
        fw_common.loss(self.global_rank, batch_idx, loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Watch(L.Callback):
    def on_train_start(self, trainer, pl_module):
        fw_common.watch(trainer.strategy.model)


def main() -> None:
    L.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Watch()])
    trainer.fit(Net(), DataLoader(data, batch_size=8))  # CALL:bucket
    fw_common.teardown()


if __name__ == "__main__":
    main()
