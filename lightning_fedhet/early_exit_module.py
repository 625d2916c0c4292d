"""A LightningModule for early-exit networks (Fed-CIS nodes train one exit; centralised EENs a weighted sum)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_fedhet.model_zoo import EarlyExitNet, create

__all__ = ["EarlyExitClassifier"]


class EarlyExitClassifier(pl.LightningModule):
    """Cross-entropy training of an :class:`~lightning_fedhet.model_zoo.EarlyExitNet` with SGD.

    Training loss:

    * ``train_exit = e`` (Fed-CIS local step, Alg. 6 line 9): ``CE(logits_e, y)`` only. The forward pass stops at
      exit ``e`` (``model(x, upto=e)``), so parameters deeper than exit ``e`` (later blocks and heads) receive **no
      gradient** (``grad is None``) and SGD leaves them untouched; shallower heads get none either.
    * ``train_exit = None``: ``sum_e exit_weights[e] * CE(logits_e, y)`` (the centralised EEN objective (5.1));
      ``exit_weights`` default to ``1/E`` each and are used as given (not renormalised).

    Validation/test log ``{val,test}_acc_exit{e}`` and ``{val,test}_loss_exit{e}`` for every exit, plus
    ``val_acc``/``val_loss`` (and ``test_...``) of the final exit. ``validation_step``/``test_step`` return
    ``{"exit_logits": [...], "labels": y}`` (detached) for callbacks such as ``CISAccuracy``.

    Args:
        model: an ``EarlyExitNet`` or a model-zoo name (default ``"ee_resnet18_cifar10"``).
        num_classes: classes (passed to the model-zoo factory; sizes the metrics).
        train_exit: 1-based exit trained by ``training_step``, or ``None`` for the weighted multi-exit loss.
        exit_weights: per-exit loss weights (length ``num_exits``, ``>= 0``) for ``train_exit=None``.
        lr, momentum, weight_decay: SGD settings (thesis App. F: 0.1, 0.9, 5e-4).
        model_kwargs: extra keyword arguments for the model-zoo factory.

    Shapes: batch ``(x [B, C, H, W], y [B])``; ``forward(x, upto=None)`` returns a list of ``[B, num_classes]``.
    """

    def __init__(
        self,
        model: str | EarlyExitNet = "ee_resnet18_cifar10",
        num_classes: int = 10,
        train_exit: int | None = None,
        exit_weights: Sequence[float] | None = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        model_kwargs: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else None)
        net = model if isinstance(model, nn.Module) else create(model, num_classes=num_classes, **(model_kwargs or {}))
        if not isinstance(net, EarlyExitNet):
            raise ValueError(f"model must be an EarlyExitNet (or the name of one), got {type(net).__name__}")
        for pname, val in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not val >= 0:
                raise ValueError(f"{pname} must be >= 0, got {val}")
        self.model = net
        e = net.num_exits
        if exit_weights is None:
            weights = torch.full((e,), 1.0 / e)
        else:
            weights = torch.as_tensor(list(exit_weights), dtype=torch.float32)
            if weights.numel() != e or not torch.isfinite(weights).all() or (weights < 0).any():
                raise ValueError(
                    f"exit_weights must be {e} finite numbers >= 0 (one per exit), got {list(exit_weights)}"
                )
        self.register_buffer("exit_weights", weights, persistent=False)
        self.train_exit: int | None = None
        self.set_train_exit(train_exit)
        self.val_acc = nn.ModuleList(MulticlassAccuracy(num_classes=num_classes, average="micro") for _ in range(e))
        self.test_acc = nn.ModuleList(MulticlassAccuracy(num_classes=num_classes, average="micro") for _ in range(e))
        # the final exit again, under the generic names val_acc/test_acc (a metric object is logged under one name)
        self.val_acc_final = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc_final = MulticlassAccuracy(num_classes=num_classes, average="micro")

    @property
    def num_exits(self) -> int:
        return self.model.num_exits

    def set_train_exit(self, e: int | None) -> None:
        """Select the exit trained by ``training_step`` (1-based), or ``None`` for the weighted multi-exit loss."""
        bad = isinstance(e, bool) or not isinstance(e, numbers.Integral) or not 1 <= e <= self.num_exits
        if e is not None and bad:
            raise ValueError(f"train_exit must be None or an exit index in [1, {self.num_exits}], got {e!r}")
        self.train_exit = None if e is None else int(e)

    def configure_client(self, train_exit: int | None = None) -> None:
        """Federated hook: the server rule (e.g. ``FedCIS``) tells this client which exit to train this round."""
        self.set_train_exit(train_exit)

    def forward(self, x: Tensor, upto: int | None = None) -> list[Tensor]:
        return self.model(x, upto=upto)

    def exit_losses(self, batch) -> tuple[Tensor, list[Tensor]]:
        """``(loss, per-exit CE losses)`` for ``batch = (x, y)`` under the current ``train_exit`` setting."""
        x, y = batch[0], batch[1]
        if self.train_exit is not None:
            logits = self.model(x, upto=self.train_exit)
            loss = F.cross_entropy(logits[-1], y)
            return loss, [loss]
        losses = [F.cross_entropy(lg, y) for lg in self.model(x)]
        loss = sum(w * lo for w, lo in zip(self.exit_weights, losses))
        return loss, losses

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss, _ = self.exit_losses(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch, metrics: nn.ModuleList, final: MulticlassAccuracy, prefix: str) -> dict:
        x, y = batch[0], batch[1]
        logits = self.model(x)
        for e, (lg, metric) in enumerate(zip(logits, metrics), start=1):
            metric.update(lg, y)
            self.log(f"{prefix}_acc_exit{e}", metric)
            self.log(f"{prefix}_loss_exit{e}", F.cross_entropy(lg, y))
        final.update(logits[-1], y)
        self.log(f"{prefix}_acc", final, prog_bar=True)
        self.log(f"{prefix}_loss", F.cross_entropy(logits[-1], y))
        return {"exit_logits": [lg.detach() for lg in logits], "labels": y}

    def validation_step(self, batch, batch_idx: int) -> dict:
        return self._evaluate(batch, self.val_acc, self.val_acc_final, "val")

    def test_step(self, batch, batch_idx: int) -> dict:
        return self._evaluate(batch, self.test_acc, self.test_acc_final, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
