"""``lightning-fedhet`` console script: LightningCLI with the federated strategy, models and datamodules.

Usage::

    lightning-fedhet fit --config configs/quickstart.yaml
    lightning-fedhet fit --config configs/quickstart.yaml --trainer.max_epochs=10 --trainer.logger=WandbLogger
    lightning-fedhet test --config configs/quickstart.yaml --ckpt_path=...
    lightning-fedhet --version

Exit status: 0 on success, 2 for a configuration error (one line on stderr names the failing argument and its
allowed values; set ``JSONARGPARSE_DEBUG=true`` for the full traceback), 1 if training itself fails.

The resolved configuration is saved as ``config.yaml`` in the run's log directory; with a ``WandbLogger`` it is also
the W&B run's config (under ``cli``) and a run file (``lightning_config.yaml``). W&B runs offline unless an API key
is configured (``WANDB_API_KEY`` or ``wandb login``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

import lightning_fedhet
import lightning_fedhet.callbacks  # noqa: F401  (listed among the known Callback subclasses)
import lightning_fedhet.classifier  # noqa: F401  (listed among the known LightningModule subclasses)
import lightning_fedhet.data  # noqa: F401  (listed among the known LightningDataModule subclasses)
import lightning_fedhet.early_exit_module  # noqa: F401

__all__ = ["FedHetCLI", "FedHetSaveConfigCallback", "ConfigError", "main"]

DESCRIPTION = (
    "lightning-fedhet: federated learning under client heterogeneity with PyTorch Lightning. "
    "Trains a LightningModule as N simulated clients with trainer.strategy=lightning_fedhet.FedHetStrategy "
    "(server rule: algorithm; who shows up: participation; lossy links: channel; work per client: local_steps). "
    "One epoch is one communication round: trainer.max_epochs is the number of rounds. "
    "Example: lightning-fedhet fit --config configs/quickstart.yaml --trainer.max_epochs=20. "
    "Models: --model=lightning_fedhet.classifier.Classifier or any LightningModule; data: "
    "--data=lightning_fedhet.data.FashionMNISTFederated (see 'lightning-fedhet fit --help' for the choices)."
)
FIT_DESCRIPTION = (
    "Train the model federatedly: each epoch is one round of the strategy's server rule over the simulated "
    "clients (trainer.max_epochs = rounds; validation every trainer.check_val_every_n_epoch rounds)."
)


class ConfigError(ValueError):
    """A configuration value was rejected while building the model, data, strategy or trainer."""


class FedHetSaveConfigCallback(SaveConfigCallback):
    """Saves ``config.yaml`` in the log directory (as Lightning does) and attaches it to every W&B run.

    W&B: the resolved configuration becomes the run config under ``cli`` (``cli.trainer.max_epochs``, ...) and
    the run file ``lightning_config.yaml`` (W&B keeps its own ``config.yaml`` in the same folder).
    """

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if not loggers:
            return
        text = self.parser.dump(self.config, skip_none=False)
        config = yaml.safe_load(text)
        for logger in loggers:
            run = logger.experiment
            run.config.update({"cli": config}, allow_val_change=True)
            path = Path(run.dir) / "lightning_config.yaml"
            path.write_text(text)
            run.save(str(path), base_path=run.dir, policy="now")


class FedHetCLI(LightningCLI):
    """LightningCLI with federated defaults: any LightningModule / LightningDataModule (subclass mode), the
    config saved with the run (:class:`FedHetSaveConfigCallback`), a federated ``--help`` and ``--version``,
    and configuration errors raised as one-line :class:`ConfigError`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args:
            kwargs.setdefault("model_class", pl.LightningModule)
            kwargs.setdefault("datamodule_class", pl.LightningDataModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_callback", FedHetSaveConfigCallback)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        parser_kwargs = dict(kwargs.pop("parser_kwargs", None) or {})
        parser_kwargs.setdefault("description", DESCRIPTION)
        parser_kwargs.setdefault("fit", {"description": FIT_DESCRIPTION})
        super().__init__(*args, parser_kwargs=parser_kwargs, **kwargs)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.add_argument("--version", action="version", version=version_string())

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as err:
            if os.environ.get("JSONARGPARSE_DEBUG", "").lower() in ("1", "true", "yes", "on"):
                raise
            config = self.config[self.subcommand] if self.subcommand else self.config
            raise ConfigError(describe_config_error(err, config)) from None


def version_string() -> str:
    return (
        f"lightning-fedhet {lightning_fedhet.__version__} (lightning {pl.__version__}, torch {torch.__version__}, "
        f"python {sys.version.split()[0]})"
    )


# Lines of jsonargparse's union-type errors that only say which alternative types did not fit.
_NOISE = ("Expected a <class", "Does not validate against any of the Union subtypes", "Given value", "Subtypes:")


def describe_config_error(err: BaseException, config: Any) -> str:
    """One line for an instantiation error: ``<config key>: <the class's own message> (<class>)``.

    jsonargparse reports a failing nested class as a tree of union alternatives; the class's own message is the
    first list item that is not a type mismatch, and the failing value is the next ``Given value: ...`` at a
    shallower indent. The key is where that value's class sits in ``config``; when the message names one of the
    class's init arguments, the key goes down to it (``...participation.init_args.k``).
    """
    lines = str(err).splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.startswith("- ") or stripped[2:].startswith(_NOISE):
            continue
        message = stripped[2:]
        indent = len(line) - len(line.lstrip())
        given = next(
            (
                later.strip()[len("Given value: ") :]
                for later in lines[i + 1 :]
                if later.strip().startswith("Given value: ") and len(later) - len(later.lstrip()) < indent
            ),
            "",
        )
        candidates = []  # (key, class_path, argument named in the message or None)
        for class_path in dict.fromkeys(re.findall(r"class_path='([^']+)'", given)):
            for key, node in _find_class(config, class_path):
                if str(node) in given:
                    candidates.append((key, class_path, _named_argument(node, message)))
        if not candidates:
            return message
        key, class_path, argument = next((c for c in candidates if c[2] is not None), candidates[0])
        if argument is not None:
            key = f"{key}.init_args.{argument}"
        return f"{key}: {message} ({class_path})"
    return lines[0] if lines else type(err).__name__


def _named_argument(node: Namespace, message: str) -> str | None:
    """The init argument of ``node`` that ``message`` names first (as a whole word), if any."""
    init_args = node.get("init_args") or Namespace()
    positions = {}
    for name in vars(init_args):
        found = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)
        if found:
            positions[name] = found.start()
    return min(positions, key=positions.get) if positions else None


def _find_class(config: Any, class_path: str) -> list[tuple[str, Namespace]]:
    """``(key, value)`` of every value in ``config`` whose ``class_path`` is ``class_path``."""
    found: list[tuple[str, Namespace]] = []

    def walk(node: Any, key: str) -> None:
        children = vars(node) if isinstance(node, Namespace) else node if isinstance(node, dict) else None
        if children is not None:
            if children.get("class_path") == class_path:
                found.append((key, node))
            for name, child in children.items():
                walk(child, f"{key}.{name}" if key else name)
        elif isinstance(node, (list, tuple)):
            for j, item in enumerate(node):
                walk(item, f"{key}[{j}]")

    walk(config, "")
    return found


def main(args: list[str] | None = None) -> int:
    """Entry point of the ``lightning-fedhet`` console script (and ``python -m lightning_fedhet.cli``).

    Returns the exit status: 0 on success, 2 for a configuration error (reported on stderr in one line).
    """
    _wandb_offline_unless_logged_in()
    try:
        FedHetCLI(args=args)
    except ConfigError as err:
        print(f"lightning-fedhet: error: {err}", file=sys.stderr)
        return 2
    return 0


def _wandb_offline_unless_logged_in() -> None:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return
    netrc = Path.home() / ".netrc"
    if not (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")):
        os.environ["WANDB_MODE"] = "offline"


if __name__ == "__main__":
    sys.exit(main())
