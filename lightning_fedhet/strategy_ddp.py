"""FedHetDDPStrategy: the same federated run, with each round's clients split over many processes.

The processes are those of a ``torch.distributed`` process group started by Lightning's own launchers
(``Trainer(devices=..., num_nodes=...)``, ``torchrun``, SLURM, or any Lightning cluster environment). Every process
draws the same round plan (a pure function of the seed and the round), trains its share of the cohort with the
chosen engine, pads with no-op steps up to the busiest process's step count, and at the round's last step the
processes combine their partial weighted sums in one all-reduce (plus a small gather of per-client scalars), so that
every process holds the same global model, algorithm state and history as a one-process run. See
:mod:`lightning_fedhet.distributed` and :mod:`lightning_fedhet.engines.sharded`.

The model is **not** wrapped in ``DistributedDataParallel``: that would all-reduce gradients at every local step of
unrelated clients. Every process starts from rank 0's initial parameters instead.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fedhet._checks import check_choice
from lightning_fedhet.algorithms.base import Algorithm
from lightning_fedhet.distributed import PLACEMENTS, ProcessGroupComm
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.spec import FederationSpec, spec_from_arguments
from lightning_fedhet.strategy_base import FederatedStrategyMixin


class FedHetDDPStrategy(FederatedStrategyMixin, DDPStrategy):
    """Simulate federated training of the user's LightningModule on several processes (and nodes).

    Takes every argument of :class:`~lightning_fedhet.FedHetStrategy` (but ``device``: Lightning gives each process
    its device; ``engine`` defaults to ``"sequential"`` here, and ``"auto"`` is refused) and gives the same run, up
    to the floating-point order of the sums over clients, plus:

    Args:
        placement: which process trains which client: ``"balanced"`` (by local steps, longest first, ties by
            client id), ``"by_client"`` (client ``i`` on process ``i % world_size``), or ``None`` (default):
            ``"by_client"`` when the server keeps per-client state (FedVARP / MIFA / FedStale memories, which the
            processes then shard by client id, or ``optimizer_state="persist"``), else ``"balanced"``.
        process_group_backend: ``"gloo"`` (CPU), ``"nccl"`` (GPU) or ``None`` (Lightning's default for the device).
        timeout: the process group's timeout for collectives.
        start_method: how Lightning starts the processes: ``"popen"`` (re-runs the script; torchrun and SLURM start
            them themselves), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        spec: the federation's settings as one :class:`~lightning_fedhet.spec.FederationSpec` instead of the
            keyword arguments (its ``engine`` must not be ``"auto"``, the spec's default: set it).

    Differences from one process:

    * a Lightning step is one step of the busiest process (``global_step`` and step-interval LR schedulers count
      those); one Lightning epoch is still one round;
    * values logged in ``training_step`` are reported once per round (``on_epoch``), aggregated over every client
      on every process (see :mod:`lightning_fedhet.engines.sharded`), so ``sync_dist=True`` never blocks;
    * settings that synchronise the processes at every step are refused at setup (``sync_batchnorm=True`` /
      ``SyncBatchNorm``, a ``DistributedDataParallel``-wrapped submodule, torchmetrics with
      ``dist_sync_on_step=True``), as is ``accumulate_grad_batches != 1``.

    Example (2 CPU processes; ``torchrun --nproc_per_node=2 train.py`` with ``devices=2`` works the same)::

        strategy = FedHetDDPStrategy(algorithm=FedAvg(), participation=UniformSample(100), local_steps=5)
        Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=50).fit(model, datamodule=data)
    """

    strategy_name = "fedhet_ddp"

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
        compile: bool | str = False,
        seed: int | None = None,
        optimizer_state: str = "reset",
        client_weights: str = "uniform",
        max_update_norm: float | None = None,
        update_norm_action: str = "reject",
        placement: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        *,
        spec: FederationSpec | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        settings = dict(
            algorithm=algorithm,
            participation=participation,
            local_steps=local_steps,
            selection=selection,
            channel=channel,
            latency=latency,
            deadline=deadline,
            num_clients=num_clients,
            partitioner=partitioner,
            engine=engine,
            compile=compile,
            seed=seed,
            optimizer_state=optimizer_state,
            client_weights=client_weights,
            max_update_norm=max_update_norm,
            update_norm_action=update_norm_action,
        )
        if isinstance(spec, FederationSpec):  # checked already; what many processes refuse is checked here too
            engine, optimizer_state = spec.engine, spec.optimizer_state
        if engine == "auto":
            raise ValueError(
                "FedHetDDPStrategy takes engine='sequential' or 'vmap' (engine='auto' is FedHetStrategy's, one "
                "process): name one, in a FederationSpec too (its default is 'auto')"
            )
        if placement is not None:
            check_choice(placement, "placement", PLACEMENTS, alternatives="None")
        if placement == "balanced" and optimizer_state == "persist":
            raise ValueError(
                "placement='balanced' cannot keep optimizer_state='persist': a client's optimizer state lives on the "
                "process that trains it, so pass placement='by_client' (or None)"
            )
        self._init_federation(spec_from_arguments(spec, FedHetDDPStrategy.__init__, settings))
        if not self.algorithm.shares_rounds:
            raise TypeError(
                f"{type(self.algorithm).__name__} does not declare how to merge a round split over processes: "
                "implement Algorithm.round_shares() and set shares_rounds = True to use it with FedHetDDPStrategy"
            )
        self.placement = placement
        self.comm = ProcessGroupComm()
        self._shared_seed: int | None = None

    # ------------------------------------------------------------------ public state
    @property
    def seed(self) -> int:
        """The seed of every draw, rank 0's (so that every process draws the same plans)."""
        return super().seed if self._shared_seed is None else self._shared_seed

    @property
    def effective_placement(self) -> str | None:
        """The placement in use (``placement``, or the one ``None`` resolved to when the fit started; ``None``
        before)."""
        return None if self._engine is None else self._engine.placement

    # ------------------------------------------------------------------ Lightning plumbing
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        _refuse_step_collectives(self.lightning_module)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            _refuse_step_collectives(self.lightning_module)  # sync_batchnorm=True converts the module in setup
            self._shared_seed = None
            self._shared_seed = int(self.broadcast(self.seed))

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel`` wrapper; every process starts from rank 0's parameters and buffers."""
        if self.comm.world_size == 1:
            return
        with torch.no_grad():
            for tensor in itertools.chain(self.model.parameters(), self.model.buffers()):
                dist.broadcast(tensor.data, src=0)

    def _engine_placement(self) -> dict[str, Any]:
        """This process's engine runs its part of every round; which clients is decided here, before the server is
        built (the rule shards its per-client state by client id before it allocates it)."""
        return {"comm": self.comm, "placement": self._placement()}

    def _placement(self) -> str:
        world = self.comm.world_size
        reasons = []
        if world > 1 and self.algorithm.shard_client_state(self.comm.rank, world):
            reasons.append(f"{type(self.algorithm).__name__}'s per-client memory")
        if self.optimizer_state_mode == "persist":
            reasons.append("optimizer_state='persist'")
        if not reasons:
            return self.placement or "balanced"
        if self.placement == "balanced":
            raise ValueError(
                f"placement='balanced' cannot be used with {' and '.join(reasons)}: that state is sharded by client id "
                "(client i on process i % world_size); pass placement='by_client' or None"
            )
        return "by_client"

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if out is None:
            # A padding step, or the vmap engine (it stepped its own copies). Lightning refuses None from a
            # training_step under several processes; a zero leaf has no path to the parameters, and optimizer_step
            # below skips the optimizer for these steps.
            return torch.zeros((), device=self.root_device, requires_grad=True)
        return out

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._engine.steps_module_optimizer:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        closure()  # the (padding or vmap) training_step; the user's optimizer must not step
        return None

    def end_partial_round(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
            # another process may never reach the merge's collectives: leave the round unmerged
            if self._engine is not None:
                self._engine.abandon_round()
            return
        super().end_partial_round()

    def _server_state(self) -> dict:
        """The server state with every process's share of per-client state gathered (independent of the number of
        processes); collective: every process calls it (Lightning saves checkpoints on every process)."""
        state = self.comm.gather_rows(self.server.state_dict())
        state["client_optim_states"] = self.comm.union(state["client_optim_states"])
        return state

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("fedhet_ddp", "popen"), ("fedhet_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"Federated simulation on several processes, start_method={start_method!r} "
                "(lightning-fedhet)",
                start_method=start_method,
            )


def _refuse_step_collectives(module: torch.nn.Module) -> None:
    """Refuse what would synchronise the processes at every step: they train different clients (and some pad)."""
    for name, sub in module.named_modules():
        where = f"module '{name}'" if name else "the LightningModule"
        if isinstance(sub, DistributedDataParallel):
            raise ValueError(
                f"{where} is wrapped in DistributedDataParallel, which all-reduces gradients at every step across "
                "processes that train different clients: FedHetDDPStrategy merges client updates once per round; "
                "pass the unwrapped module"
            )
        if isinstance(sub, torch.nn.SyncBatchNorm):
            raise ValueError(
                f"{where} is a SyncBatchNorm (Trainer(sync_batchnorm=True)?), which all-reduces batch statistics "
                "of unrelated clients at every step and would block on processes that pad: use BatchNorm (the "
                "server averages its statistics every round) or GroupNorm"
            )
        if getattr(sub, "dist_sync_on_step", False) is True:  # a torchmetrics Metric (not one of ours)
            raise ValueError(
                f"{where} ({type(sub).__name__}) has dist_sync_on_step=True, a collective at every step that "
                "processes which pad never join: create the metric with dist_sync_on_step=False"
            )


if "fedhet_ddp" not in StrategyRegistry:
    FedHetDDPStrategy.register_strategies(StrategyRegistry)
