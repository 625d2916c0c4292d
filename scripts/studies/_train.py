"""What every study shares: a quiet Lightning run of a federated strategy with an evaluation curve.

Rounds are 1-based in curves: ``curve[k] = (round, {"val_acc": ..., ...})`` after ``round`` rounds of training.
Every draw of the federation is seeded by the strategy's ``seed``; :func:`seed_all` seeds the model's
initialisation (Python, numpy, torch), so a (cell, seed) pair is one reproducible run.
"""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback


def quiet() -> None:
    """Silence Lightning's banners and the per-run notices that say nothing about a simulation on a CPU."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def seed_all(seed: int) -> None:
    """Seed Python, numpy and torch (the model's initialisation); the federation's draws come from the strategy."""
    seed_everything(int(seed), workers=False, verbose=False)


class MetricCurve(Callback):
    """``(round, {name: value})`` after every validation of the global model (``names``: logged metrics)."""

    def __init__(self, names: tuple[str, ...] = ("val_acc",)) -> None:
        self.names = names
        self.curve: list[tuple[int, dict[str, float]]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        if trainer.sanity_checking or not all(n in metrics for n in self.names):
            return
        self.curve.append((trainer.current_epoch + 1, {n: float(metrics[n]) for n in self.names}))


def fit(model, datamodule, strategy, rounds: int, eval_every: int, names: tuple[str, ...] = ("val_acc",),
        callbacks: tuple = ()) -> list[tuple[int, dict[str, float]]]:
    """Train ``rounds`` rounds (one Lightning epoch each), validating every ``eval_every`` rounds and at the end."""
    quiet()
    curve = MetricCurve(names)
    trainer = Trainer(
        strategy=strategy, max_epochs=int(rounds), check_val_every_n_epoch=int(eval_every), logger=False,
        callbacks=[curve, *callbacks], enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        # the strategy's device decides (a CPU study on a GPU machine would otherwise get CUDA and be refused)
        accelerator="cpu" if strategy.root_device.type == "cpu" else "auto",
    )
    trainer.fit(model, datamodule=datamodule)
    if not curve.curve or curve.curve[-1][0] != rounds:
        trainer.validate(model, datamodule=datamodule, verbose=False)
        curve.on_validation_end(trainer, model)
        if curve.curve and curve.curve[-1][0] != rounds:  # validate() does not advance current_epoch
            curve.curve[-1] = (int(rounds), curve.curve[-1][1])
    return curve.curve


def eval_trainer() -> Trainer:
    """A quiet ``Trainer`` for ``validate`` alone (no logger, progress bar or checkpoints)."""
    quiet()
    return Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                   accelerator="cpu")  # the studies' models are on the CPU, whatever the machine has


def series(curve: list[tuple[int, dict[str, float]]]) -> dict[str, list[float]]:
    """``{"round": [...], name: [...]}`` from a curve, for a record's ``metrics``."""
    out: dict[str, list[float]] = {"round": [r for r, _ in curve]}
    for name in curve[0][1] if curve else ():
        out[name] = [round(m[name], 6) for _, m in curve]
    return out


def data_checksum(client_indices, *tensors) -> str:
    """sha256 (hex) of the training data a run actually used: each client's size, then every tensor (inputs,
    labels after any relabelling) gathered in client order (``lightning_fedhet.experiments.checksum``, the one
    implementation). Two runs with the same checksum trained on the same bytes with the same partition."""
    from lightning_fedhet.experiments import checksum

    return checksum(client_indices, *tensors)
