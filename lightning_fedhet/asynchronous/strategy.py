"""FedASTStrategy: Lightning's loop drives the asynchronous multi-task server (FedAST paper, Algorithm 2).

Decision: the strategy drives Lightning's own training loop rather than a separate runner, so loggers, callbacks,
checkpoints, precision plugins and ``LightningCLI`` work as for any Lightning run. Several models train at once
through one :class:`~lightning_fedhet.asynchronous.MultiTaskModule` (one ordinary LightningModule per task,
manual optimization, one optimizer per task):

- every Lightning step is one local step of one request; requests come in the order their updates reach the
  server (simulated time), each running ``local_steps`` steps of its task on its client's data;
- at a request's first step the model version it carried is copied into its task's module and that task's
  optimizer state is cleared; after its last step its delta ``w_local - w_sent`` goes to the server;
- **one Lightning epoch ends at the next server step** (a full buffer of any task, a dynamic reallocation, or the
  end of a Sync-ST round); every task module then holds its global model, so validation, checkpoints,
  ``trainer.validate`` and ``trainer.test`` see the global models. ``max_epochs`` therefore bounds the number of
  server steps over all tasks;
- the server's state (models, pending requests, queues, buffers, history) goes into Lightning checkpoints under
  ``"fedast"``; resuming continues exactly.

Not taken in this version (a clear error at construction if passed): ``engine=`` (each request trains through
Lightning's loop, one at a time; the vmap engine trains a synchronous cohort in lock-step) and ``channel=`` (a lost
upload is not modelled in the asynchronous server).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from typing_extensions import override

from lightning_fedhet.asynchronous.latency import Constant, as_request_latency
from lightning_fedhet.asynchronous.module import MultiTaskModule
from lightning_fedhet.asynchronous.pool import ClientPool, resolve_pool
from lightning_fedhet.asynchronous.rules import FedAST, SyncST
from lightning_fedhet.asynchronous.task import Request, Task
from lightning_fedhet.asynchronous.task_server import TaskServer
from lightning_fedhet.data.datamodule import FederatedDataModule
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.flat import FlatModel
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.system.latency import ShiftedExponential
from lightning_fedhet.trainer_device import TrainerDeviceMixin

LatencySpec = float | Constant | ShiftedExponential


class FedASTStrategy(TrainerDeviceMixin, SingleDeviceStrategy):
    """Train the tasks of a :class:`~lightning_fedhet.asynchronous.MultiTaskModule` with FedAST or Sync-ST.

    Args:
        rule: :class:`~lightning_fedhet.asynchronous.FedAST` (default ``FedAST()``) or
            :class:`~lightning_fedhet.asynchronous.SyncST`.
        pool: the client pool (:class:`~lightning_fedhet.asynchronous.CappedPool`, the paper's: uniform draws
            over all clients, at most a fraction of them busy, requests beyond the cap skipped; or
            :class:`~lightning_fedhet.asynchronous.AvailabilityPool`). Default: ``CappedPool(0.3)``, unless
            ``participation`` is given.
        participation: shorthand for ``pool=AvailabilityPool(participation, slot)``: which clients accept
            requests, ``participation.sample(floor(t / slot))`` at simulated time ``t`` (FedAST),
            ``participation.sample(round)`` (Sync-ST); requests wait for an available client.
        latency: request duration, one for every task or a mapping task -> model: seconds (constant), a
            :class:`~lightning_fedhet.asynchronous.Constant` or a
            :class:`~lightning_fedhet.system.ShiftedExponential` (the paper's; ``steps="scale"``:
            ``tau * s_i * (shift + Exp(mean))`` seconds).
        local_steps: ``tau_m >= 1`` local steps per request: an int or a mapping task -> int.
        slot: seconds per availability slot (with ``participation``; FedAST only).
        num_clients: optional check of the client count every task's datamodule must have.
        seed: seed of every draw (clients, durations, availability, each client's data order).
        device: where every task's clients train; ``None`` (default): the Trainer's device, as
            :class:`~lightning_fedhet.FedHetStrategy`. An explicit device the Trainer's accelerator cannot use is
            refused at setup.

    It takes no ``engine`` and no ``channel`` (a clear error names why, see the module doc).

    Attributes:
        server: the :class:`~lightning_fedhet.asynchronous.TaskServer` (after the fit starts).
        history: ``server.history``: one dict per server step (task, round, sim_time in seconds, staleness of
            each applied update, R, b, ...).

    Example::

        module = MultiTaskModule({"cnn": cnn, "lr": logreg}, datamodules={"cnn": fmnist_dm, "lr": synthetic_dm})
        strategy = FedASTStrategy(FedAST(option="D", requests=16, buffer=2, server_lr=0.1), local_steps=27,
                                  latency={"cnn": ShiftedExponential.fedast("fmnist"),
                                           "lr": ShiftedExponential.fedast("mnist")})
        trainer = Trainer(strategy=strategy, max_epochs=10_000, check_val_every_n_epoch=12,
                          callbacks=[TimeToTarget({"cnn": 0.8, "lr": 0.7})])
        trainer.fit(module)
        strategy.history[-1]["sim_time"]   # simulated seconds at the last server step
    """

    strategy_name = "fedast"

    def __init__(
        self,
        rule: FedAST | SyncST | None = None,
        participation: Participation | None = None,
        pool: ClientPool | None = None,
        latency: LatencySpec | dict[str, LatencySpec] = 1.0,
        local_steps: int | dict[str, int] = 1,
        slot: float = 1.0,
        num_clients: int | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **synchronous_only: Any,
    ) -> None:
        _refuse_synchronous_settings(synchronous_only)
        super().__init__(
            device=device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        rule = FedAST() if rule is None else rule
        if not isinstance(rule, (FedAST, SyncST)):
            raise TypeError(f"rule must be FedAST(...) or SyncST(...), got {type(rule).__name__}")
        if participation is not None and not isinstance(participation, Participation):
            raise TypeError(f"participation must be a Participation process, got {type(participation).__name__}")
        resolve_pool(pool, participation, slot if float(slot) > 0 else 1.0)  # both given, or a wrong type: refuse
        for name, value in (latency.items() if isinstance(latency, Mapping) else [("latency", latency)]):
            as_request_latency(value, f"latency[{name!r}]" if name != "latency" else "latency")
        for name, value in (local_steps.items() if isinstance(local_steps, Mapping) else [("", local_steps)]):
            if isinstance(value, bool) or int(value) != value or int(value) < 1:
                raise ValueError(f"local_steps{f'[{name!r}]' if name else ''} must be an integer >= 1, got {value!r}")
        if not float(slot) > 0:
            raise ValueError(f"slot must be > 0 seconds, got {slot!r}")
        if num_clients is not None and int(num_clients) < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.rule = rule
        self.participation = participation
        self.pool = pool
        self.latency = latency
        self.local_steps = local_steps
        self.slot = float(slot)
        self.num_clients = num_clients
        self.seed = int(seed)
        self.server: TaskServer | None = None
        self.streams: dict[str, ClientStreams] = {}
        self.flats: dict[str, FlatModel] = {}
        self._schedule: list[tuple[Request, int]] = []
        self._losses: list[float] = []
        self._epoch_records: list[dict] = []
        self._pending_state: dict | None = None

    # ------------------------------------------------------------------ Lightning plumbing
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"FedASTStrategy needs Trainer(accumulate_grad_batches=1), got "
                             f"{trainer.accumulate_grad_batches}; set the clients' work with local_steps instead")
        if not isinstance(self.model, MultiTaskModule):
            raise TypeError(f"FedASTStrategy trains a MultiTaskModule (one LightningModule per task), got "
                            f"{type(self.model).__name__}")
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not any(isinstance(c, _Hooks) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _Hooks(self))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self.server is None:
            self._setup_server()
        return _EpochLoader(self)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.server is not None:
            checkpoint["fedast"] = self.server.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._pending_state = checkpoint.get("fedast")
        return checkpoint

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        request, step = self._schedule[batch_idx]
        if step == 0:
            self._start_request(request)

    # ------------------------------------------------------------------ server
    def _setup_server(self) -> None:
        module: MultiTaskModule = self.lightning_module
        names = module.task_names
        latency = self._per_task(self.latency, names, "latency")
        steps = self._per_task(self.local_steps, names, "local_steps")
        sizes = set()
        tasks = {}
        for i, name in enumerate(names):
            dm = module.datamodules[name]
            if not isinstance(dm, FederatedDataModule):
                raise TypeError(f"task {name!r}: FedASTStrategy needs a FederatedDataModule (per-client data), got "
                                f"{type(dm).__name__}")
            sizes.add(len(dm.client_indices))
            loader = dm.train_dataloader()
            self.streams[name] = ClientStreams(dm.train_dataset, dm.client_indices, batch_size=dm.batch_size,
                                               seed=self.seed, collate_fn=loader.collate_fn)
            self.flats[name] = FlatModel(module.tasks[name])
            lr = float(self.optimizers[i].param_groups[0]["lr"])
            tasks[name] = Task(self.flats[name].get(), local_steps=int(steps[name]), latency=latency[name],
                               client_lr=lr)
        if len(sizes) != 1:
            raise ValueError(f"every task must be split over the same client pool; the datamodules hold "
                             f"{sorted(sizes)} clients")
        num_clients = sizes.pop()
        if self.num_clients is not None and self.num_clients != num_clients:
            raise ValueError(f"num_clients={self.num_clients} but the datamodules hold {num_clients} clients")
        self.server = self.rule.build(tasks, num_clients, participation=self.participation, slot=self.slot,
                                      seed=self.seed, pool=self.pool)
        if self._pending_state is not None:
            self.server.load_state_dict(self._pending_state)
            self._pending_state = None
            for name in names:
                if name not in self.server.active_tasks:
                    module.stop(name)
        self._load_globals()

    @staticmethod
    def _per_task(value: Any, names: list[str], what: str) -> dict[str, Any]:
        if isinstance(value, Mapping):
            if set(value) != set(names):
                raise ValueError(f"{what} names tasks {sorted(value)}, but the tasks are {names}")
            return dict(value)
        return {n: value for n in names}

    def _load_globals(self) -> None:
        for name, flat in self.flats.items():
            flat.set(self.server.params(name))

    def _start_request(self, request: Request) -> None:
        self.flats[request.task].set(self.server.sent_params(request))
        self.optimizers[self.lightning_module.task_names.index(request.task)].state.clear()
        self._losses = []

    def _end_step(self, batch_idx: int, outputs: Any) -> None:
        request, step = self._schedule[batch_idx]
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(float(loss.detach()))
        if step + 1 < request.local_steps:
            return
        sent = self.server.sent_params(request)
        delta = self.flats[request.task].get(sent.dtype).to(sent.device) - sent
        loss = float(np.mean(self._losses)) if self._losses else float("nan")
        self._epoch_records += self.server.submit(request, delta, loss)
        if request.closes:
            self._load_globals()

    def stop_task(self, task: str) -> None:
        """Stop training ``task`` now (its requests go to the other tasks) and stop evaluating it."""
        self.server.stop_task(task)
        self.lightning_module.stop(task)

    @property
    def history(self) -> list[dict]:
        return [] if self.server is None else self.server.history

    def epoch_metrics(self) -> dict[str, float]:
        """The last epoch's server steps as flat metrics (``sim_time``, ``<task>/round``, ``<task>/staleness``
        (mean over the applied updates), ``<task>/R``, ``<task>/b``)."""
        if self.server is None:
            return {}
        metrics = {"sim_time": float(self.server.clock)}
        for record in self._epoch_records:
            task = record["task"]
            metrics[f"{task}/round"] = float(record["round"])
            if record["staleness"]:
                metrics[f"{task}/staleness"] = float(np.mean(record["staleness"]))
            metrics[f"{task}/R"] = float(record["R"])
            metrics[f"{task}/b"] = float(record["b"])
        return metrics

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Asynchronous simultaneous training of several models (FedAST)"
        )


def _refuse_synchronous_settings(given: dict[str, Any]) -> None:
    """``engine=`` and ``channel=`` belong to the synchronous strategies: name why this one takes neither; any other
    unknown argument is a TypeError, as Python gives it."""
    if "engine" in given:
        raise ValueError(
            f"FedASTStrategy takes no engine (got engine={given['engine']!r}): each request trains through "
            "Lightning's loop, one at a time, while the vmap engine trains a synchronous cohort in lock-step"
        )
    if "channel" in given:
        raise ValueError(
            "FedASTStrategy takes no channel: lossy channels are not modelled in the asynchronous server in this "
            "version; use FedHetStrategy(channel=...) with a synchronous rule"
        )
    if given:
        raise TypeError(f"FedASTStrategy.__init__() got an unexpected keyword argument {next(iter(given))!r}")


class _EpochLoader:
    """The local steps of arriving requests, up to and including the request that closes a server step."""

    def __init__(self, strategy: FedASTStrategy) -> None:
        self.strategy = strategy

    def __iter__(self):
        self.strategy._schedule = []
        self.strategy._epoch_records = []
        return self._batches()

    def _batches(self):
        strategy = self.strategy
        server = strategy.server
        while True:
            request = server.pop()
            if request is None:  # every task has stopped
                strategy.lightning_module.trainer.should_stop = True
                return
            streams = strategy.streams[request.task]
            indices = streams.batch_indices(request.data_key, request.client, request.local_steps)
            for step, batch in enumerate(streams.iterate(indices)):
                strategy._schedule.append((request, step))
                yield request.task, batch
            if request.closes:
                return


class _Hooks(Callback):
    """Internal: ties requests to Lightning's batch hooks and logs the epoch's server steps."""

    def __init__(self, strategy: FedASTStrategy) -> None:
        self.strategy = strategy

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.strategy._end_step(batch_idx, outputs)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = self.strategy.epoch_metrics()
        if not metrics or not trainer.loggers:
            return
        record = {**metrics, "epoch": trainer.current_epoch}
        for logger in trainer.loggers:
            logger.log_metrics(record, step=trainer.global_step)


if "fedast" not in StrategyRegistry:
    FedASTStrategy.register_strategies(StrategyRegistry)
