"""The Lightning plumbing every federated strategy shares (one process and many).

:class:`FederatedStrategyMixin` is mixed in before a Lightning strategy class (``SingleDeviceStrategy`` for
:class:`~lightning_fedhet.strategy.FedHetStrategy`, ``DDPStrategy`` for ``FedHetDDPStrategy``). It keeps the run's
:class:`~lightning_fedhet.spec.FederationSpec`, has it build the :class:`~lightning_fedhet.server.Server` and binds the
engine when Lightning hands over the train dataloader, forwards Lightning's batch hooks to the engine, swaps the global
model in for validation inside a round, and carries the server's state in checkpoints. ``_RoundLoader`` makes each
Lightning epoch one round; ``_RoundHooks`` ties the rounds to Lightning's batch and epoch hooks.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fedhet._third_party import quiet_third_party_notices
from lightning_fedhet.callbacks.round_metrics import RoundMetrics
from lightning_fedhet.engines.auto import EngineChoice, FitFacts
from lightning_fedhet.engines.base import Engine, EngineBatch
from lightning_fedhet.engines.registry import check_val_interval, choose
from lightning_fedhet.federated_run import FederatedRun
from lightning_fedhet.flat import FlatModel
from lightning_fedhet.server import Server
from lightning_fedhet.spec import FederationSpec

quiet_third_party_notices()


#: the module's and the datamodule's hooks that ``Strategy.batch_to_device`` calls
_TRANSFER_HOOKS = ("transfer_batch_to_device", "on_after_batch_transfer")


class FederatedStrategyMixin(FederatedRun):
    """The Lightning plumbing shared by :class:`FedHetStrategy` (one process) and ``FedHetDDPStrategy`` (many).

    Mixed in before a Lightning strategy class, whose methods it extends through ``super()``. The run's public
    state (the spec's settings, ``history``, ``global_params``, ...) is
    :class:`~lightning_fedhet.federated_run.FederatedRun`'s.
    """

    def _init_federation(self, spec: FederationSpec) -> None:
        """Keep the run's (checked) spec and prepare the engine (shared by the strategies' ``__init__``)."""
        self.spec = spec
        self.server: Server | None = None
        self.flat: FlatModel | None = None
        self._plain_transfer = False  # set in setup(): no transfer hook is overridden
        self._epoch_steps = 0  # Lightning steps in the current epoch (round)
        self._warned_unreached_validation = False
        #: what engine='auto' picked and why (None for an explicit engine, or before the fit chose)
        self.engine_choice: EngineChoice | None = None
        # the fit's engine, chosen once its server exists (lightning_fedhet.engines.registry.choose); None before
        self._engine: Engine | None = None
        self._engine_options: dict[str, Any] = {}
        self._pending_state: dict | None = None

    def build_server(
        self, module: pl.LightningModule, dataloader: object, datamodule: object
    ) -> tuple[Server, FlatModel]:
        """The run's :class:`Server` (global model = ``module``'s current state, this strategy's spec and seed)
        and ``module``'s flat view, from Lightning's train ``dataloader`` and the ``datamodule`` (or None)."""
        seed = self.seed
        streams = self.spec.client_streams(dataloader, datamodule, seed)
        flat = FlatModel(module)
        with torch.no_grad():
            init = flat.get()
        server = self.spec.build_server(init, flat.num_parameters, seed, streams=streams, init_ints=flat.get_ints())
        return server, flat

    # ------------------------------------------------------------------ Lightning plumbing
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            # accumulated gradients would leak from one client into the next
            raise ValueError(
                f"{type(self).__name__} needs Trainer(accumulate_grad_batches=1), got "
                f"{trainer.accumulate_grad_batches}; set the clients' work with local_steps instead"
            )
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_interval < 1.0:
            # a fraction of an epoch is undefined: rounds differ in length and are planned when they start
            raise ValueError(
                f"Trainer(val_check_interval={trainer.val_check_interval}) is a fraction of an epoch, but a round's "
                "length is only known when it starts: pass an int number of steps (validation then sees the global "
                "model) or use check_val_every_n_epoch"
            )
        interval = _interval_inside_epoch(trainer)
        super().setup(trainer)
        check_val_interval(self.engine, interval)
        if trainer.state.fn == TrainerFn.FITTING and self.engine_choice is not None:
            self._engine = self.engine_choice = None  # a choice is a fit's: the next fit chooses again
        # Lightning dispatches the transfer hooks (about 40 us a batch on a CPU) even when nobody overrides them;
        # every local step pays it, so the default behaviour is run directly when neither the module nor the
        # datamodule overrides a hook.
        owners = (trainer.lightning_module, trainer.datamodule)
        self._plain_transfer = not any(is_overridden(hook, owner) for hook in _TRANSFER_HOOKS for owner in owners)
        if trainer.state.fn == TrainerFn.FITTING and not any(isinstance(c, _RoundHooks) for c in trainer.callbacks):
            # First in the list, so user callbacks' batch-end/epoch-end hooks see the closed round; the round's
            # metrics are published right after it (callback metrics, loggers, the federated config).
            trainer.callbacks.insert(0, _RoundHooks(self))
            if not any(isinstance(c, RoundMetrics) for c in trainer.callbacks):
                trainer.callbacks.insert(1, RoundMetrics())

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self.server is None or self._pending_state is not None:
            self._engine, self._engine_options = None, self._engine_placement()
            self.server, self.flat = self.build_server(self.lightning_module, dataloader, trainer.datamodule)
            if self._pending_state is not None:
                self.server.load_state_dict(self._pending_state)
                self._pending_state = None
        if self._engine is None:
            self._engine, choice = choose(
                self.engine, self.compile, self._fit_facts(trainer), self.server, **self._engine_options
            )
            if choice is not None:  # engine='auto': said once, with its reason
                self.engine_choice = choice
                rank_zero_info(choice.describe())
        self.algorithm.check_client_solver(self.optimizers[0], self.optimizer_state_mode)
        self._engine.check_lr_schedulers([config.interval for config in self.lr_scheduler_configs])
        self._engine.setup(self.lightning_module, self.optimizers, self.server, self.flat, self.batch_to_device)
        return _RoundLoader(self._engine)

    def _engine_placement(self) -> dict[str, Any]:
        """Where the fit's engine trains which client, decided before the server is built (one process: here)."""
        return {}

    def _fit_facts(self, trainer: pl.Trainer) -> FitFacts:
        """What the engine choice reads of this fit."""
        return FitFacts(
            module=self.lightning_module,
            optimizers=self.optimizers,
            scheduler_intervals=[config.interval for config in self.lr_scheduler_configs],
            val_interval_inside_epoch=_interval_inside_epoch(trainer),
            device=self.root_device,
            rounds=trainer.max_epochs,
            to_device=self.batch_to_device,
        )

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, EngineBatch):  # the engine moves each piece when it uses it
            return batch
        if self._plain_transfer:  # what LightningModule.transfer_batch_to_device does, without the hook dispatch
            return move_data_to_device(batch, device or self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._engine.on_batch_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        batch, batch_idx = args[0], args[1]
        return self._engine.training_step(super().training_step, batch, batch_idx)

    @override
    def on_validation_start(self) -> None:
        if self._engine is not None:
            self._engine.hold_global()

    @override
    def on_validation_end(self) -> None:
        if self._engine is not None:
            self._engine.release_global()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.server is not None:
            checkpoint["fedhet"] = self._server_state()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _server_state(self) -> dict:
        """The server's state as checkpoints hold it."""
        return self.server.state_dict()

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if path.is_file() and path.stat().st_size == 0:
            raise ValueError(f"checkpoint {str(path)!r} is empty (0 bytes): it was not written completely")
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except (EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
            raise ValueError(
                f"checkpoint {str(checkpoint_path)!r} cannot be read ({type(err).__name__}): the file is truncated "
                "or is not a Lightning checkpoint"
            ) from err
        self._pending_state = checkpoint.get("fedhet")
        return checkpoint

    def on_round_batch_end(self, outputs: Any) -> None:
        """After each Lightning step (called from the internal callback, before any user callback)."""
        self._epoch_steps += 1
        self._engine.on_batch_end(outputs)

    def end_epoch(self, trainer: pl.Trainer) -> None:
        """After each epoch: close a round cut short, and say once if an int ``val_check_interval`` was out of reach."""
        self.end_partial_round()
        interval, steps = _interval_inside_epoch(trainer), self._epoch_steps
        self._epoch_steps = 0
        if interval is not None and 0 < steps < interval and not self._warned_unreached_validation:
            # a round can be shorter than the interval (rounds differ in length)
            self._warned_unreached_validation = True
            warnings.warn(
                f"Trainer(val_check_interval={interval}) was not reached in round {self.server.next_round - 1}, "
                f"which had {steps} Lightning step(s): Lightning counts the interval inside each epoch (round), so "
                f"that round was not validated. Add check_val_every_n_epoch=None to count steps across rounds",
                stacklevel=2,
            )

    def end_partial_round(self) -> None:
        """Close a round that Lightning cut short, so the module and the server hold the global model."""
        if self.server is None or not self.server.round_open:
            return
        plan = self.server.plan
        self._engine.finish_partial_round()
        record = self.server.history[-1]
        warnings.warn(
            f"round {plan.round} was cut short (max_steps, limit_train_batches, fast_dev_run or an interruption): "
            f"it was closed with the {len(record['received'])} update(s) that had arrived; clients that had not "
            "finished count as not arrived",
            stacklevel=2,
        )


def _interval_inside_epoch(trainer: pl.Trainer) -> int | None:
    """``Trainer(val_check_interval=N)`` when Lightning counts ``N`` steps inside each epoch (each round), i.e. an int
    with ``check_val_every_n_epoch`` set; ``None`` otherwise (a fraction, or steps counted across epochs)."""
    interval = trainer.val_check_interval
    if isinstance(interval, int) and trainer.check_val_every_n_epoch is not None:
        return interval
    return None


class _RoundLoader:
    """The round's batches (no ``__len__``: rounds differ in length).

    Lightning creates the epoch's iterator (and prefetches from it) before ``on_train_epoch_start``, so the round
    is opened here. Rounds are counted by the server, not by ``trainer.current_epoch``, which still names the
    previous epoch when a run resumes from an end-of-epoch checkpoint.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __iter__(self):
        return self.engine.round_batches()


class _RoundHooks(Callback):
    """Internal: ties rounds to Lightning's batch and epoch hooks."""

    def __init__(self, strategy: FederatedStrategyMixin) -> None:
        self.strategy = strategy

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.strategy.on_round_batch_end(outputs)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.end_epoch(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.end_partial_round()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.strategy.end_partial_round()
