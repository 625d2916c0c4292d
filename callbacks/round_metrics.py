"""Round metrics: ``round/*`` in ``trainer.callback_metrics`` and every logger, and the federated config.

One Lightning epoch is one communication round. When a round closes (the strategy appends its record to
``strategy.history``), :class:`RoundMetrics`

* puts the round's counts into ``trainer.callback_metrics`` as ``round/<name>`` scalars, so
  ``ModelCheckpoint(monitor="round/received", mode="max")`` and ``EarlyStopping`` can use them;
* logs them once per round to every attached Lightning logger, with a ``round`` column (rounds completed,
  1-based) that W&B uses as the x-axis of every chart: a round that validates is logged in its validation's row
  (same step, one row, through ``LightningModule.log_dict`` in ``on_validation_epoch_end``); a round that does not
  is logged straight to the loggers at the trainer's global step;
* warns when every update of a round was rejected as non-finite, and when a run ends with no update ever
  aggregated.

At ``setup`` of ``fit`` it logs the federated configuration (``lightning_fedhet.config_summary.federated_config``)
under ``fedhet`` with every logger's ``log_hyperparams``. With ``engine="auto"`` the engine that runs is chosen later,
on the first round's data, so the configuration is logged again at ``on_train_start`` with its keys
(``fedhet.engine.ran``, ``fedhet.engine.compile``) added: new keys, every other value unchanged (a logger such as MLflow
refuses a logged value that changes). TensorBoard's logger writes ``hparams.yaml`` once, before that, and never again;
the callback rewrites it then, so that it holds the engine that ran too.

Cost per round: ~11 floats into ``callback_metrics`` and one ``log_metrics`` call per logger. Only validated rounds
go through ``LightningModule.log_dict`` (about a millisecond per metric, small next to a validation pass).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_fedhet.config_summary import engine_ran, federated_config
from lightning_fedhet.history import round_metrics

from ._common import federated_strategy, wandb_loggers

__all__ = ["RoundMetrics", "round_metrics"]


class RoundMetrics(Callback):
    """Publish each closed round's ``round/*`` metrics (callback metrics + loggers) and the federated config.

    ``FedHetStrategy`` adds one to the trainer by default; adding it yourself is harmless (the strategy then does
    not add a second one).

    Args:
        log_config: log the federated configuration with ``log_hyperparams`` when ``fit`` sets up.
        round_axis: with a ``WandbLogger`` attached, make ``round`` the x-axis of every W&B chart
            (``define_metric("*", step_metric="round")``).
    """

    def __init__(self, log_config: bool = True, round_axis: bool = True) -> None:
        self.log_config = bool(log_config)
        self.round_axis = bool(round_axis)
        self._published = 0
        self._unlogged: list[dict] = []
        self._announced = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        federated_strategy(trainer, type(self).__name__)
        if stage == TrainerFn.FITTING:
            # Before Lightning logs the model's hyper-parameters and saves them: TensorBoard writes hparams.yaml
            # once, with everything logged so far.
            self._announce(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._announce(trainer)  # when added after the setup hooks ran (no-op if setup announced already)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING:
            self._announced = False

    def _announce(self, trainer: pl.Trainer) -> None:
        """Federated config to every logger's hyper-parameters; ``round`` as the W&B x-axis. Once per fit."""
        if self._announced:
            return
        self._announced = True
        if self.log_config:
            strategy = federated_strategy(trainer, type(self).__name__)
            config = federated_config(strategy, trainer.datamodule)
            if strategy.spec.engine == "auto":
                # not chosen yet (a choice read here would be an earlier fit's): logged at on_train_start
                for key in engine_ran(strategy):
                    config.pop(key)
            for logger in trainer.loggers:
                logger.log_hyperparams({"fedhet": config})
        if self.round_axis:
            for logger in wandb_loggers(trainer):
                run = logger.experiment
                run.define_metric("round")
                # step_sync: rows without a "round" value (Lightning's own rows) take the latest one
                run.define_metric("*", step_metric="round", step_sync=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = federated_strategy(trainer, type(self).__name__)
        # rounds restored from a checkpoint were published by the run that trained them
        self._published = len(strategy.history)
        self._unlogged = []
        if self.log_config and strategy.spec.engine == "auto" and engine_ran(strategy):
            # The fit's engine is chosen by now (when Lightning handed the strategy the train dataloader). The whole
            # config again: loggers replace a top-level key's value (``fedhet``), they do not merge into it.
            config = {"fedhet": federated_config(strategy, trainer.datamodule)}
            for logger in trainer.loggers:
                logger.log_hyperparams(config)
                if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                    _rewrite_hparams_yaml(logger)

    # A round closes in the strategy's batch-end hook (or at the epoch's start when nobody trains). Its metrics
    # enter callback_metrics at the first of these hooks, before the round's validation and ModelCheckpoint.
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._publish(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._publish(trainer)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validated round is logged in the validation's own row (same step, one row), through the module's
        # log so that Lightning's logger connector writes both together.
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return
        self._publish(trainer)
        if not self._unlogged:
            return
        *earlier, record = self._unlogged
        self._log_direct(trainer, earlier)
        pl_module.log_dict(self._row(trainer, record), on_step=False, on_epoch=True, batch_size=1)
        self._unlogged = []

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._publish(trainer)
        self._log_direct(trainer, self._unlogged)
        self._unlogged = []

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        history = federated_strategy(trainer, type(self).__name__).history
        if history and not any(len(record["received"]) for record in history):
            rank_zero_warn(
                f"The run ended after {len(history)} round(s) with no client update ever aggregated: no update "
                "reached the server or every one was rejected. Check participation, the channel's loss "
                "probabilities, the deadline and the model's numerics."
            )

    def _publish(self, trainer: pl.Trainer) -> None:
        """Newly closed rounds: into callback_metrics, warned about, queued for logging."""
        history = trainer.strategy.history
        if len(history) <= self._published:
            return
        callback_metrics = trainer.callback_metrics
        for record in history[self._published :]:
            for name, value in round_metrics(record).items():
                callback_metrics[name] = torch.tensor(value, dtype=torch.float64)
            if len(record["rejected"]) and not len(record["received"]):
                rank_zero_warn(
                    f"Round {record['round']}: every client update ({len(record['rejected'])}) was rejected as "
                    "non-finite; no fresh update was aggregated this round."
                )
            self._unlogged.append(record)
        self._published = len(history)

    @staticmethod
    def _row(trainer: pl.Trainer, record: dict) -> dict[str, float]:
        return {**round_metrics(record), "round": float(record["round"] + 1)}

    def _log_direct(self, trainer: pl.Trainer, records: list[dict]) -> None:
        """Rounds that did not validate: one row each, straight to every logger at the trainer's global step."""
        for record in records:
            row = {**self._row(trainer, record), "epoch": trainer.current_epoch}
            for logger in trainer.loggers:
                logger.log_metrics(row, step=trainer.global_step)


def _rewrite_hparams_yaml(logger: TensorBoardLogger) -> None:
    """Write ``logger``'s hyper-parameters to its ``hparams.yaml`` again, as its ``save()`` would, were the file not
    there already (it writes the file only when it is missing)."""
    path = f"{logger.log_dir}/{logger.NAME_HPARAMS_FILE}"
    if get_filesystem(path).isfile(path):
        save_hparams_to_yaml(path, logger.hparams)
