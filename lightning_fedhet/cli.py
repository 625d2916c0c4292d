"""``lightning-fedhet`` console script: LightningCLI with the federated strategy and datamodules.

Usage::

    lightning-fedhet fit --config configs/quickstart.yaml
    lightning-fedhet fit --config configs/quickstart.yaml --trainer.max_epochs=10 --trainer.logger=WandbLogger
    lightning-fedhet test --config configs/quickstart.yaml --ckpt_path=...

W&B runs offline unless an API key is configured (``WANDB_API_KEY`` or ``wandb login``).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_fedhet  # noqa: F401  (registers the "fedhet" strategy)


def _wandb_offline_unless_logged_in() -> None:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return
    netrc = Path.home() / ".netrc"
    if not (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")):
        os.environ["WANDB_MODE"] = "offline"


def main(args: list[str] | None = None) -> LightningCLI:
    """Entry point of the ``lightning-fedhet`` console script (and ``python -m lightning_fedhet.cli``)."""
    _wandb_offline_unless_logged_in()
    return LightningCLI(
        pl.LightningModule,
        # None: any LightningDataModule subclass, and `data:` may be left out when the model brings its own
        # dataloaders (lightning_fedhet.asynchronous.MultiTaskModule holds one datamodule per task)
        None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        # Lightning's CLI would hand the top-level model's config as hyperparameters to *every* LightningModule it
        # builds, so the task modules nested in a MultiTaskModule would lose their own (and a nested datamodule
        # without a top-level `data:` crashes). Each module saves its own hyperparameters instead.
        load_from_checkpoint_support=False,
        args=args,
    )


if __name__ == "__main__":
    main()
