"""A ready-made LightningModule for classification (used by the quickstart and the CLI).

Nothing in it is federated: it is the kind of module a user already has.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_fedhet.model_zoo import create


class Classifier(pl.LightningModule):
    """Cross-entropy classifier trained with SGD.

    Args:
        model: a model-zoo name (``"fmnist_cnn"``, ``"logistic_regression"``, ...) or an ``nn.Module``.
        num_classes: classes (also passed to the model-zoo factory).
        lr: SGD learning rate (the client learning rate in a federated run).
        momentum: SGD momentum.
        weight_decay: L2 penalty (the thesis's ridge term for linear models).
        lr_decay: factor applied to ``lr`` after every epoch, i.e. every federated round (1.0: constant).
        model_kwargs: extra keyword arguments for the model-zoo factory.
    """

    def __init__(
        self,
        model: str | nn.Module = "fmnist_cnn",
        num_classes: int = 10,
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_decay: float = 1.0,
        model_kwargs: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else None)
        self.model = (
            model if isinstance(model, nn.Module) else create(model, num_classes=num_classes, **(model_kwargs or {}))
        )
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch, metric: MulticlassAccuracy, prefix: str) -> None:
        x, y = batch
        logits = self(x)
        metric.update(logits, y)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, y), prog_bar=False)
        self.log(f"{prefix}_acc", metric, prog_bar=True)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_acc, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_acc, "test")

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        if hp.lr_decay == 1.0:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, hp.lr_decay)}
