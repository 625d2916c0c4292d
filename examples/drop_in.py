"""Drop-in: an ordinary LightningModule and LightningDataModule, trained as 50 federated clients.

Nothing below the line marked "federated" knows about federated learning; the only change to a
centralised run is the Trainer's ``strategy`` argument (and ``max_epochs`` now counts rounds).

    python examples/drop_in.py
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TwoMoons(pl.LightningDataModule):
    """A user's datamodule: a noisy 2-D two-class problem."""

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(0)
        t = torch.rand(4000, generator=gen) * torch.pi
        label = torch.randint(0, 2, (4000,), generator=gen)
        x = torch.stack([torch.cos(t) + label, torch.sin(t) * (1 - 2 * label) + 0.5 * label], 1)
        x += 0.15 * torch.randn(x.shape, generator=gen)
        self.train_set = TensorDataset(x[:3000], label[:3000])
        self.val_set = TensorDataset(x[3000:], label[3000:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=500)


class MLP(pl.LightningModule):
    """A user's model."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


if __name__ == "__main__":
    # ---- federated: the only lines that differ from centralised training ----
    from lightning_fedhet import Dirichlet, FedHetStrategy, UniformSample

    strategy = FedHetStrategy(
        num_clients=50, partitioner=Dirichlet(0.3), participation=UniformSample(10), local_steps=10
    )
    trainer = Trainer(strategy=strategy, max_epochs=30, enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, enable_model_summary=False)
    # -------------------------------------------------------------------------
    model = MLP()
    trainer.fit(model, datamodule=TwoMoons())
    print(f"val_acc of the global model after {len(strategy.history)} rounds: "
          f"{float(trainer.callback_metrics['val_acc']):.4f}")
