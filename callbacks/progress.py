"""Plain-text per-round progress, for terminals, CI logs and notebooks without a progress bar."""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class RoundPrinter(Callback):
    """Prints one line per federated round (one Lightning epoch).

    Example output::

        round   5/40 | received 10/10 available | local steps   200 | val_acc 0.7449 | 22.6 s

    Args:
        metrics: logged metric names to show when present (validation runs only every
            ``check_val_every_n_epoch`` rounds, so they may be absent).
        every_n_rounds: print every n-th round (and always the last one).
    """

    def __init__(self, metrics: tuple[str, ...] = ("val_acc", "val_loss"), every_n_rounds: int = 1) -> None:
        if every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be >= 1, got {every_n_rounds}")
        self.metrics = tuple(metrics)
        self.every_n_rounds = every_n_rounds
        self._start = 0.0
        self._validated = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validated = not trainer.sanity_checking

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        history = getattr(trainer.strategy, "history", None)
        if not history:
            return
        record = history[-1]
        round_no = record["round"] + 1
        last = trainer.max_epochs is not None and round_no >= trainer.max_epochs
        if round_no % self.every_n_rounds and not last:
            return
        parts = [
            f"round {round_no:>4}/{trainer.max_epochs}",
            f"received {len(record['received'])}/{len(record['available'])} available",
            f"local steps {sum(record['local_steps'].values()):>5}",
        ]
        metrics = trainer.callback_metrics
        for name in self.metrics:
            if name in metrics and self._validated:
                parts.append(f"{name} {float(metrics[name]):.4f}")
        parts.append(f"{time.perf_counter() - self._start:.1f} s")
        self._validated = False
        print(" | ".join(parts), flush=True)
