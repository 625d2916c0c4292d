"""FedHetStrategy: the user's LightningModule trains as ``N`` federated clients.

A thin Lightning adapter. One Lightning epoch is one communication round. The strategy builds, once per fit,

* a :class:`~lightning_fedhet.server.Server` (framework-free: the round's plan, the global model, the rule, the
  history, the checkpointed state), and
* the fit's engine (:mod:`lightning_fedhet.engines`: ``"sequential"`` or ``"vmap"``, as named, or as
  ``engine="auto"``, the default, picks it for this fit),

then forwards Lightning's hooks to the engine (on the Trainer's device unless ``device=`` names one): the train
dataloader becomes the round's batches (:meth:`Engine.round_batches`), each batch's start/step/end goes to the engine,
validation inside a round sees the global model, and the server's state travels in Lightning's checkpoints under
``"fedhet"``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from typing_extensions import override

from lightning_fedhet.algorithms.base import Algorithm
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.spec import FederationSpec, spec_from_arguments
from lightning_fedhet.strategy_base import FederatedStrategyMixin
from lightning_fedhet.trainer_device import (  # noqa: F401  (check_device_matches_accelerator, resolve_device: re-exported)
    TrainerDeviceMixin,
    check_device_matches_accelerator,
    resolve_device,
)


class FedHetStrategy(FederatedStrategyMixin, TrainerDeviceMixin, SingleDeviceStrategy):
    """Simulate federated training of the user's LightningModule.

    Args:
        algorithm: server rule (default ``FedAvg()``).
        participation: availability process (default ``Full()``).
        local_steps: local optimizer steps per selected client per round: int >= 1, a per-client
            sequence, or a per-round draw such as ``UniformSteps(low, high)``.
        selection: optional server selection among available clients, ``UniformSample(k)``; default: the
            algorithm's ``select`` (all available clients). Rules with their own sampler refuse it.
        channel: optional ``LossyChannel(uplink=..., downlink=...)``; default: lossless.
        latency: optional per-client latency model (e.g. ``ShiftedExponential``) driving the simulated
            clock: a round lasts until its slowest arrived update (or the deadline).
        deadline: optional per-round deadline in simulated seconds; updates arriving later are dropped.
        num_clients: number of clients when the datamodule is a plain LightningDataModule.
        partitioner: how to split a plain datamodule's training set (``IID()``, ``Dirichlet(a)``, or index lists).
        engine: ``"auto"`` (default: vmap, compiled where it pays, when the run passes vmap's checks and vmap pays
            on the device; sequential otherwise; it says once per fit which it picked and why,
            ``strategy.engine_choice`` keeps it and the loggers get it as ``fedhet.engine.ran``; see
            :mod:`lightning_fedhet.engines.auto`), ``"sequential"`` (one client at a time through Lightning's loop,
            any module) or ``"vmap"`` (the round's cohort in lock-step with ``torch.func``, one Lightning step per
            round).
        compile: ``engine="vmap"`` or ``"auto"``: ``True`` compiles the cohort step with ``torch.compile``,
            ``"reduce-overhead"`` adds CUDA graphs on a GPU; a model that cannot be compiled falls back to the
            eager cohort with one warning (see docs/performance.md for when it pays). ``None`` (default): not
            compiled, except where ``engine="auto"`` finds that compiling pays.
        seed: seed of every random draw (participation, selection, channel, data order); ``None`` takes
            Lightning's global seed (``seed_everything``), else 0.
        optimizer_state: ``"reset"`` (fresh optimizer state for each client each round) or ``"persist"``
            (each client keeps its own optimizer state across rounds; memory grows with N). The vmap engine keeps
            SGD's momentum buffers; other optimizers run ``"persist"`` on the sequential engine.
        client_weights: ``alpha_i`` passed to the algorithm: ``"uniform"`` (1/N) or ``"samples"`` (|D_i|/|D|).
        max_update_norm: optional bound on the L2 norm of a client's parameter update (robustness).
        update_norm_action: ``"reject"`` (such an update is rejected and counted, like a non-finite one) or
            ``"clip"`` (it is scaled down to the bound).
        device: the device clients train on; ``None`` (default): the Trainer's device (the first of its
            accelerator's devices, as Lightning's own single-device strategy takes it), CPU until a Trainer is
            attached. An explicit device the Trainer's accelerator cannot use is refused at setup.
        spec: the federation's settings as one :class:`~lightning_fedhet.spec.FederationSpec` (then leave the
            arguments above, ``device`` excepted, at their defaults): ``FedHetStrategy(spec=FederationSpec(...))``.

    Attributes:
        spec: the run's :class:`~lightning_fedhet.spec.FederationSpec` (the arguments above are read from it:
            ``strategy.local_steps`` is ``strategy.spec.local_steps``).
        server: the run's :class:`~lightning_fedhet.server.Server` (``None`` before fitting).
        history: one dict per closed round (see :func:`lightning_fedhet.history.round_record`).
        rejected_total: client updates rejected as non-finite so far.

    Example::

        strategy = FedHetStrategy(algorithm=FedAvg(), participation=UniformSample(10), local_steps=5)
        trainer = Trainer(strategy=strategy, max_epochs=50)  # 50 rounds
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
        engine: str = "auto",
        compile: bool | str | None = None,
        seed: int | None = None,
        optimizer_state: str = "reset",
        client_weights: str = "uniform",
        max_update_norm: float | None = None,
        update_norm_action: str = "reject",
        device: str | torch.device | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        *,
        spec: FederationSpec | None = None,
    ) -> None:
        super().__init__(
            device=device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
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
        self._init_federation(spec_from_arguments(spec, FedHetStrategy.__init__, settings))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Federated simulation of heterogeneous clients (lightning-fedhet)"
        )


if "fedhet" not in StrategyRegistry:
    FedHetStrategy.register_strategies(StrategyRegistry)
