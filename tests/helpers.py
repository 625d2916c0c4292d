"""Small models and data shared by the tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.utils.data import TensorDataset


class TinyClassifier(pl.LightningModule):
    """Linear softmax classifier with plain SGD: an ordinary LightningModule, nothing federated."""

    def __init__(self, in_features: int = 5, num_classes: int = 3, lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        gen = torch.Generator().manual_seed(123)
        self.linear = torch.nn.Linear(in_features, num_classes)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(num_classes, in_features, generator=gen) * 0.1)
            self.linear.bias.zero_()

    def forward(self, x):
        return self.linear(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def toy_dataset(n: int = 120, in_features: int = 5, num_classes: int = 3, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=gen)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    return TensorDataset(x, y)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def quiet_trainer(**kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)
