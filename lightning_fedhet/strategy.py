"""FedHetStrategy: the user's LightningModule trains as ``N`` federated clients (DESIGN.md §2.2).

One Lightning epoch is one communication round and each Lightning step is one local step of one
client. The user's ``training_step`` and ``configure_optimizers`` are the client solver, untouched:

* at an epoch's start the round is planned (:class:`~lightning_fedhet.federation.Federation`);
* the train dataloader is replaced by the round's mini-batches, client after client;
* at a client's first step the global weights are copied into the module and the optimizer state is
  reset (or the client's own state restored, ``optimizer_state="persist"``);
* after a client's last step its delta ``w_i - w_t`` is streamed into the algorithm, unless it is not
  finite (rejected and counted) or its uplink was lost (work wasted);
* after the round's last step the algorithm's new global weights are copied into the module, so
  validation, checkpoints, ``trainer.validate`` and ``trainer.test`` see the global model;
* at the epoch's end the round's record goes to ``strategy.history`` and its counts (``round/received``,
  ``round/local_steps``, ``round/upload_bytes``, ``round/sim_time``, ...) to every attached Lightning logger
  (W&B, CSV, TensorBoard, ...), at the trainer's global step, with the ``epoch``.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader

from lightning_fedhet.algorithms.base import Algorithm, ClientInfo
from lightning_fedhet.algorithms.fedavg import FedAvg
from lightning_fedhet.data.datamodule import split_dataset
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import Federation, RoundPlan
from lightning_fedhet.flat import FlatModel
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.participation.full import Full
from lightning_fedhet.system.steps import check_local_steps

ENGINES = ("sequential", "vmap")
OPTIMIZER_STATES = ("reset", "persist")
CLIENT_WEIGHTS = ("uniform", "samples")


class FedHetStrategy(SingleDeviceStrategy):
    """Simulate federated training of the user's LightningModule.

    Args:
        algorithm: server rule (default ``FedAvg()``).
        participation: availability process (default ``Full()``).
        local_steps: local optimizer steps per selected client per round: int >= 1, a per-client
            sequence, or a per-round draw with ``sample(round, num_clients, seed)``.
        selection: optional server selection among available clients, e.g. ``UniformSample(k)``;
            default: the algorithm's ``select`` (all available clients).
        channel: optional lossy channel (``downlink``/``uplink``); default: lossless.
        latency: optional per-client latency model (e.g. ``ShiftedExponential``) driving the simulated
            clock: a round lasts until its slowest trained client answers (or the deadline).
        deadline: optional per-round deadline in simulated seconds; updates arriving later are dropped.
        num_clients: number of clients when the datamodule is a plain LightningDataModule.
        partitioner: how to split a plain datamodule's training set (``IID()``, ``Dirichlet(a)``, or index lists).
        engine: ``"sequential"`` (one client at a time through Lightning's loop).
        seed: seed of every random draw (participation, selection, channel, data order).
        optimizer_state: ``"reset"`` (fresh optimizer state for each client each round) or ``"persist"``
            (each client keeps its own optimizer state across rounds; memory grows with N).
        client_weights: ``alpha_i`` passed to the algorithm: ``"uniform"`` (1/N) or ``"samples"`` (|D_i|/|D|).
        device: the device clients train on.

    Attributes:
        history: one dict per closed round: ``round`` (0-based); ``available``, ``selected``, ``received``,
            ``rejected`` (sorted int64 tensors of client ids); ``local_steps`` (client id -> steps run, for the
            clients that trained); ``weights`` (client id -> weight applied to its fresh update);
            ``download_bytes``/``upload_bytes`` (this round); ``sim_time`` (cumulative simulated seconds);
            ``wasted_steps`` (steps of trained clients whose update did not count); ``memory_bytes``
            (the algorithm's per-client state).
        rejected_total: number of client updates rejected as non-finite so far.

    Example::

        trainer = Trainer(
            strategy=FedHetStrategy(algorithm=FedAvg(), participation=UniformSample(10), local_steps=5),
            max_epochs=50,  # rounds
        )
        trainer.fit(model, datamodule=FederatedDataModule(train, Dirichlet(0.5), num_clients=100))
        strategy.history[-1]["received"]  # ids whose update reached the server in the last round
    """

    strategy_name = "fedhet"

    def __init__(
        self,
        algorithm: Algorithm | None = None,
        participation: Participation | None = None,
        local_steps: Any = 1,
        selection: Any = None,
        channel: Any = None,
        latency: Any = None,
        deadline: float | None = None,
        num_clients: int | None = None,
        partitioner: Any = None,
        engine: str = "sequential",
        seed: int = 0,
        optimizer_state: str = "reset",
        client_weights: str = "uniform",
        device: str | torch.device = "cpu",
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, got {optimizer_state!r}")
        if engine == "vmap" and optimizer_state == "persist":
            raise ValueError("optimizer_state='persist' is only supported by engine='sequential'")
        if client_weights not in CLIENT_WEIGHTS:
            raise ValueError(f"client_weights must be one of {CLIENT_WEIGHTS}, got {client_weights!r}")
        if num_clients is not None and int(num_clients) < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        check_local_steps(local_steps)
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.algorithm = algorithm if algorithm is not None else FedAvg()
        self.participation = participation if participation is not None else Full()
        self.local_steps = local_steps
        self.selection = selection
        self.channel = channel
        self.latency = latency
        self.deadline = deadline
        self.num_clients = num_clients
        self.partitioner = partitioner
        self.engine = engine
        self.seed = int(seed)
        self.optimizer_state_mode = optimizer_state
        self.client_weights = client_weights

        self.history: list[dict] = []
        self.federation: Federation | None = None
        self.flat: FlatModel | None = None
        self.rejected_total = 0
        self._plan: RoundPlan | None = None
        self._global: torch.Tensor | None = None
        self._client_loss: list[float] = []
        self._client_optim_states: dict[int, list[dict]] = {}
        self._round_metrics: dict[str, float] = {}
        self._pending_state: dict | None = None
        self._rejected: list[int] = []
        self._cohorts: list = []
        self._cohort_losses: dict[int, list[float]] = {}
        self._cohort_logs: dict[str, list[torch.Tensor]] = {}
        self._round_closed = True
        self.next_round = 0

    # ------------------------------------------------------------------ Lightning plumbing
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            # accumulated gradients would leak from one client into the next
            raise ValueError(
                f"FedHetStrategy needs Trainer(accumulate_grad_batches=1), got {trainer.accumulate_grad_batches}; "
                "set the clients' work with local_steps instead"
            )
        super().setup(trainer)
        if self.engine == "vmap":
            # the cohort steps its own stacked copies and returns None to Lightning on purpose
            warnings.filterwarnings("ignore", message=r"`training_step` returned `None`.*")
        if trainer.state.fn == TrainerFn.FITTING and not any(isinstance(c, _RoundHooks) for c in trainer.callbacks):
            # First in the list, so user callbacks' batch-end/epoch-end hooks see the closed round.
            trainer.callbacks.insert(0, _RoundHooks(self))

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self._setup_federation(trainer, dataloader)
        return _RoundLoader(self)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.federation is not None:
            checkpoint["fedhet"] = self.server_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._pending_state = checkpoint.get("fedhet")
        return checkpoint

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.engine == "vmap":
            if batch_idx == 0:
                self._start_cohort()
            return
        client, step = self._plan.schedule[batch_idx]
        if step == 0:
            self._start_client(client)

    def training_step(self, *args: Any, **kwargs: Any):
        if self.engine != "vmap":
            return super().training_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1]
        module = self.lightning_module
        for cohort, group_batch in zip(self._cohorts, batch):
            losses, logged = cohort.step(group_batch, batch_idx)
            active = cohort.local_steps > batch_idx
            for i, client in enumerate(cohort.clients):
                if active[i]:
                    self._cohort_losses.setdefault(client, []).append(float(losses[i]))
            for name, values in logged.items():
                self._cohort_logs.setdefault(name, []).append(values[active])
        for name, chunks in self._cohort_logs.items():
            module.log(name, torch.cat(chunks).mean(), on_step=False, on_epoch=True, batch_size=1)
        self._cohort_logs = {}
        # The cohort stepped its own stacked copies; Lightning's optimizer has nothing to do.
        return None

    # ------------------------------------------------------------------ federation setup
    def _setup_federation(self, trainer: pl.Trainer, dataloader: object) -> None:
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"FedHetStrategy needs the train dataloader to be a torch DataLoader, got {type(dataloader).__name__}"
            )
        dataset = dataloader.dataset
        datamodule = trainer.datamodule
        if getattr(datamodule, "client_indices", None) is not None:
            client_indices = datamodule.client_indices
            if self.num_clients is not None and self.num_clients != len(client_indices):
                raise ValueError(
                    f"num_clients={self.num_clients} but the FederatedDataModule holds {len(client_indices)} clients"
                )
        elif self.partitioner is not None:
            client_indices = split_dataset(dataset, self.partitioner, self.num_clients, self.seed)
        else:
            raise ValueError(
                "FedHetStrategy does not know how to split the training data: use a FederatedDataModule, or pass "
                "FedHetStrategy(num_clients=..., partitioner=IID() | Dirichlet(alpha) | index lists)"
            )
        batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None) or 1
        streams = ClientStreams(
            dataset,
            client_indices,
            batch_size=batch_size,
            seed=self.seed,
            collate_fn=dataloader.collate_fn,
            num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory,
        )
        self.federation = Federation(
            participation=self.participation,
            algorithm=self.algorithm,
            streams=streams,
            local_steps=self.local_steps,
            selection=self.selection,
            channel=self.channel,
            latency=self.latency,
            deadline=self.deadline,
            seed=self.seed,
        )
        self.flat = FlatModel(self.lightning_module)
        sizes = torch.as_tensor(streams.sizes, dtype=torch.float64)
        alpha = sizes if self.client_weights == "samples" else None
        self.algorithm.setup(streams.num_clients, self.flat.get(), alpha)
        self.algorithm.client_sizes = torch.as_tensor(streams.sizes, dtype=torch.int64)
        if self._pending_state is not None:
            self.load_server_state_dict(self._pending_state)
            self._pending_state = None
        self._global = self.algorithm.params.clone()
        self.flat.set(self._global)

    # ------------------------------------------------------------------ rounds
    def _begin_round(self, round: int) -> None:
        fed = self.federation
        self._plan = fed.plan(round)
        self._round_closed = False
        self._rejected = []
        self._global = self.algorithm.params.clone()
        self.algorithm.open_round(round, fed.context(self._plan))
        if not self._plan.schedule:
            self._close_round()

    def _start_client(self, client: int) -> None:
        config = self.algorithm.client_config(client)
        if config:
            configure = getattr(self.lightning_module, "configure_client", None)
            if configure is None:
                raise TypeError(
                    f"{type(self.algorithm).__name__} sends {sorted(config)} to each client: the LightningModule "
                    "must define configure_client(**config) (EarlyExitClassifier does)"
                )
            configure(**config)
        self.flat.set(self._global)
        self._client_loss = []
        for i, opt in enumerate(self.optimizers):
            opt.state.clear()
            if self.optimizer_state_mode == "persist" and client in self._client_optim_states:
                _import_state(opt, self._client_optim_states[client][i])

    def _start_cohort(self) -> None:
        """vmap engine: stack the round's trained clients, grouped by mini-batch size."""
        from lightning_fedhet.engines.vmap import VmapCohort

        self.flat.set(self._global)
        module, optimizer = self.lightning_module, self.optimizers[0]
        self._cohorts = [
            VmapCohort(module, optimizer, clients, self._plan.local_steps[clients]) for clients in self._cohort_groups()
        ]
        self._cohort_losses, self._cohort_logs = {}, {}

    def _cohort_groups(self) -> list[list[int]]:
        sizes = self.federation.streams.sizes
        batch = self.federation.streams.batch_size
        groups: dict[int, list[int]] = {}
        for client in self._plan.trained_ids:
            groups.setdefault(min(batch, int(sizes[client])), []).append(client)
        return [groups[k] for k in sorted(groups)]

    def _vmap_schedule(self, plan: RoundPlan) -> list[list[np.ndarray]]:
        """Per local step, per cohort group: the stacked dataset indices ``[C_g, B_g]``."""
        by_client: dict[int, list[np.ndarray]] = {}
        for (client, _), idx in zip(plan.schedule, plan.batches):
            by_client.setdefault(client, []).append(idx)
        groups = self._cohort_groups()
        max_steps = int(plan.local_steps.max()) if plan.schedule else 0
        # A client that has finished repeats its last batch; its rows are put back after the step.
        return [
            [np.stack([by_client[c][min(k, len(by_client[c]) - 1)] for c in group]) for group in groups]
            for k in range(max_steps)
        ]

    def _end_cohort(self) -> None:
        for cohort in self._cohorts:
            deltas = cohort.flat_params().to(self._global) - self._global[: self.flat.num_parameters]
            for i, client in enumerate(cohort.clients):
                delta = self._global.new_zeros(self._global.shape)
                delta[: self.flat.num_parameters] = deltas[i]
                losses = self._cohort_losses.get(client, [])
                self._submit(client, delta, float(np.mean(losses)) if losses else float("nan"))
        self._cohorts = []

    def _end_step(self, batch_idx: int, outputs: Any) -> None:
        if self.engine == "vmap":
            if batch_idx + 1 == int(self._plan.local_steps.max()):
                self._end_cohort()
                self._close_round()
            return
        client, step = self._plan.schedule[batch_idx]
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._client_loss.append(float(loss.detach()))
        if step + 1 == self._plan.local_steps[client]:
            self._end_client(client)
            if batch_idx + 1 == len(self._plan.schedule):
                self._close_round()

    def _end_client(self, client: int) -> None:
        if self.optimizer_state_mode == "persist":
            self._client_optim_states[client] = [_export_state(opt) for opt in self.optimizers]
        delta = self.flat.get(self._global.dtype).to(self._global.device) - self._global
        self._submit(client, delta, float(np.mean(self._client_loss)) if self._client_loss else float("nan"))

    def _submit(self, client: int, delta: torch.Tensor, loss: float) -> None:
        """Send one trained client's delta up: lost, rejected as non-finite, or added to the algorithm."""
        if not bool(self._plan.arrives[client]):
            return  # uplink lost (or past the deadline): the work is wasted
        if not torch.isfinite(delta).all():
            self._rejected.append(client)
            self.rejected_total += 1
            return
        info = ClientInfo(
            num_samples=len(self.federation.streams.client_indices[client]),
            local_steps=int(self._plan.local_steps[client]),
            loss=loss,
        )
        self.algorithm.add(client, delta, info)

    def _close_round(self) -> None:
        plan = self._plan
        new_params = self.algorithm.close_round()
        if not torch.isfinite(new_params).all():
            raise FloatingPointError(f"round {plan.round}: the algorithm produced non-finite global parameters")
        self._global = new_params  # the next round starts from a clone of algorithm.params
        self.flat.set(self._global)
        self._record(plan)
        self._round_closed = True
        self.next_round = plan.round + 1

    def _record(self, plan: RoundPlan) -> None:
        model_bytes = self.flat.dim * self._global.element_size()
        rejected = torch.tensor(sorted(self._rejected), dtype=torch.int64)
        received = plan.arrives.clone()
        received[rejected] = False
        ids = lambda mask: torch.nonzero(mask).flatten().to(torch.int64)  # noqa: E731
        record = {
            "round": plan.round,
            "available": ids(plan.available),
            "selected": ids(plan.selected),
            "received": ids(received),
            "local_steps": {c: int(plan.local_steps[c]) for c in plan.trained_ids},
            "weights": dict(self.algorithm.last_weights),
            # The server sends the model to every selected client; every client that trained sends back.
            "download_bytes": int(plan.selected.sum()) * model_bytes,
            "upload_bytes": int(plan.trained.sum()) * model_bytes,
            "sim_time": (self.history[-1]["sim_time"] if self.history else 0.0) + plan.duration,
            "wasted_steps": int(plan.local_steps[(plan.trained & ~received).numpy()].sum()),
            "rejected": rejected,
            # server-side per-client state (FedVARP/MIFA/FedStale memories), 0 for stateless rules
            "memory_bytes": int(getattr(self.algorithm, "memory_bytes", 0)),
        }
        self.history.append(record)
        self._round_metrics = {
            "round/available": float(len(record["available"])),
            "round/selected": float(len(record["selected"])),
            "round/trained": float(plan.trained.sum()),
            "round/received": float(len(record["received"])),
            "round/rejected": float(len(rejected)),
            "round/local_steps": float(plan.local_steps.sum()),
            "round/upload_bytes": float(record["upload_bytes"]),
            "round/download_bytes": float(record["download_bytes"]),
            "round/sim_time": float(record["sim_time"]),
            "round/wasted_steps": float(record["wasted_steps"]),
        }

    # ------------------------------------------------------------------ server state
    def server_state_dict(self) -> dict:
        """Algorithm state (global parameters included), history and per-client optimizer states."""
        return {
            "algorithm": self.algorithm.state_dict(),
            "history": list(self.history),
            "rejected_total": self.rejected_total,
            "next_round": self.next_round,
            "client_optim_states": dict(self._client_optim_states),
        }

    def load_server_state_dict(self, state: dict) -> None:
        self.algorithm.load_state_dict(state["algorithm"])
        self.history = list(state["history"])
        self.rejected_total = int(state["rejected_total"])
        self.next_round = int(state["next_round"])
        self._client_optim_states = dict(state["client_optim_states"])

    @property
    def global_params(self) -> torch.Tensor | None:
        """The current global parameters as a flat vector ``[d]`` (None before fitting)."""
        return self.algorithm.params

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Federated simulation of heterogeneous clients (lightning-fedhet)"
        )


def _export_state(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """The optimizer's per-parameter state keyed by parameter position (so it survives a checkpoint)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: _clone(optimizer.state[p]) for i, p in enumerate(params) if p in optimizer.state}


def _import_state(optimizer: torch.optim.Optimizer, state: dict[int, dict]) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, s in state.items():
        optimizer.state[params[i]] = _clone(s)


def _clone(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class _RoundLoader:
    """The round's mini-batches, client after client (no ``__len__``: rounds differ in length)."""

    def __init__(self, strategy: FedHetStrategy) -> None:
        self.strategy = strategy

    def __iter__(self):
        # Lightning creates the epoch's iterator (and prefetches from it) before on_train_epoch_start,
        # so the round is planned here.
        # Rounds are counted by the server, not by trainer.current_epoch, which still names the
        # previous epoch when a run resumes from an end-of-epoch checkpoint.
        strategy = self.strategy
        if strategy._plan is None or strategy._round_closed:
            strategy._begin_round(strategy.next_round)
        streams = strategy.federation.streams
        if strategy.engine == "vmap":
            return (
                [streams.stacked_batch(idx) for idx in step] for step in strategy._vmap_schedule(strategy._plan)
            )
        return streams.iterate(strategy._plan.batches)


class _RoundHooks(Callback):
    """Internal: ties rounds to Lightning's epoch and batch hooks."""

    def __init__(self, strategy: FedHetStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.strategy._end_step(batch_idx, outputs)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Straight to every attached logger, as Lightning's own logger connector does at epoch end:
        # going through LightningModule.log costs ~1 ms per metric on a CPU, ten times a round.
        metrics = self.strategy._round_metrics
        if not metrics or not trainer.loggers:
            return
        record = {**metrics, "epoch": trainer.current_epoch}
        for logger in trainer.loggers:
            logger.log_metrics(record, step=trainer.global_step)


if "fedhet" not in StrategyRegistry:
    FedHetStrategy.register_strategies(StrategyRegistry)
