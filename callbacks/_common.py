"""Shared plumbing of the round callbacks: the federated strategy, W&B loggers, the run's media folder."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger

from lightning_fedhet.federated_run import FederatedRun


def federated_strategy(trainer: pl.Trainer, owner: str) -> FederatedRun:
    """``trainer.strategy`` if it is a federated strategy (``FedHetStrategy``, ``FedHetDDPStrategy``: a
    :class:`~lightning_fedhet.federated_run.FederatedRun`); a TypeError naming ``owner`` otherwise."""
    strategy = trainer.strategy
    if not isinstance(strategy, FederatedRun):
        raise TypeError(
            f"{owner} needs Trainer(strategy=FedHetStrategy(...)) or FedHetDDPStrategy(...), got "
            f"{type(strategy).__name__}"
        )
    return strategy


def wandb_loggers(trainer: pl.Trainer) -> list[WandbLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]


def media_dir(trainer: pl.Trainer) -> Path:
    """``<log dir>/media``: the logger's version folder, or ``default_root_dir`` without a logger."""
    return Path(trainer.log_dir or trainer.default_root_dir) / "media"


def figure_png(fig: Any) -> bytes:
    """PNG bytes of a matplotlib ``Figure`` (rendered off-screen by Agg; pyplot and its backend are untouched)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi)
    return buffer.getvalue()


def save_png(fig: Any, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    path.write_bytes(figure_png(fig))
    return path


def wandb_image(fig: Any, caption: str | None = None) -> Any:
    import wandb
    from PIL import Image

    return wandb.Image(Image.open(io.BytesIO(figure_png(fig))), caption=caption)


def log_wandb(trainer: pl.Trainer, data: dict[str, Any], rounds_done: int) -> None:
    """One W&B row with ``data`` at this trainer step, on the ``round`` axis."""
    for logger in wandb_loggers(trainer):
        logger.log_metrics({**data, "round": rounds_done}, step=trainer.global_step)
