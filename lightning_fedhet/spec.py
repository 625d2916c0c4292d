"""The federation spec: every setting of one federated run in one object, checked once, and the Server it builds.

:class:`FederationSpec` holds what a federated run is (the server rule, who participates, how much each client
works, what the links lose, the clock, the server's options, the seed and the engine). It checks itself when it is
made, with the messages each setting's error has always had, so a bad setting fails before any work. The strategies
(:class:`~lightning_fedhet.FedHetStrategy`, ``FedHetDDPStrategy``, the Flower bridge's ``FedHetFlowerStrategy``) and
:func:`~lightning_fedhet.multiseed.fit_seeds` take one (``FedHetStrategy(spec=FederationSpec(...))``); the strategies'
flat keyword arguments (what LightningCLI and YAML configs use) build one. Every setting is logged: the loggers'
hyper-parameters (``fedhet.<setting>``, see :mod:`lightning_fedhet.config_summary`) list each field of the spec.

A spec builds the run's :class:`~lightning_fedhet.server.Server` from the clients' sizes (``|D_i|``): with their data
streams when the run trains here (:meth:`FederationSpec.client_streams` makes them from Lightning's train dataloader),
or from the sizes alone when the clients train elsewhere (Flower nodes).
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_fedhet._checks import check_int, check_real
from lightning_fedhet.algorithms.base import Algorithm
from lightning_fedhet.algorithms.fedavg import FedAvg
from lightning_fedhet.data.datamodule import FederatedDataModule, split_dataset
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.engines.registry import AUTO, ENGINES, check_engine_name, check_engine_options
from lightning_fedhet.federation import RoundPlanner, check_deadline
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.participation.full import Full
from lightning_fedhet.seeding import resolve_seed
from lightning_fedhet.server import Server, check_server_options
from lightning_fedhet.system.steps import check_local_steps, local_steps_for

# ENGINES: re-exported from lightning_fedhet.engines.registry, the engines' one registry (its earlier home was here)
__all__ = ["FederationSpec", "ENGINES", "SpecSetting", "spec_from_arguments"]


@dataclass(frozen=True, eq=False)
class FederationSpec:
    """Every setting of one federated run, checked when it is made (each error names the setting).

    Args:
        algorithm: server rule (default ``FedAvg()``).
        participation: availability process (default ``Full()``).
        local_steps: local optimizer steps per selected client per round: int >= 1, a per-client sequence, or a
            per-round draw such as ``UniformSteps(low, high)``.
        selection: optional server selection among available clients, ``UniformSample(k)``; default: the
            algorithm's ``select`` (all available clients). Rules with their own sampler refuse it.
        channel: optional ``LossyChannel(uplink=..., downlink=...)``; default: lossless.
        latency: optional per-client latency model (e.g. ``ShiftedExponential``) driving the simulated clock.
        deadline: optional per-round deadline in simulated seconds; updates arriving later are dropped (needs
            ``latency``).
        num_clients: number of clients when the datamodule is a plain LightningDataModule (or the Flower run's).
        partitioner: how to split a plain datamodule's training set (``IID()``, ``Dirichlet(a)``, or index lists).
        engine: ``"auto"`` (default: picked per fit, see :class:`~lightning_fedhet.FedHetStrategy`), ``"sequential"``
            or ``"vmap"``; ``FedHetDDPStrategy`` takes ``"sequential"`` or ``"vmap"`` only.
        compile: ``True`` or a ``torch.compile`` mode for the vmap engine; ``None``: not compiled, except where
            ``engine="auto"`` finds that compiling pays (an explicit engine keeps ``False``).
        seed: seed of every random draw; ``None`` takes Lightning's global seed (``seed_everything``), else 0.
        optimizer_state: ``"reset"`` (fresh optimizer state for each client each round) or ``"persist"`` (each
            client's own state across its rounds; on the vmap engine SGD's momentum buffers only).
        client_weights: ``alpha_i`` passed to the algorithm: ``"uniform"`` (1/N) or ``"samples"`` (|D_i|/|D|).
        max_update_norm: optional bound on the L2 norm of a client's parameter update.
        update_norm_action: ``"reject"`` or ``"clip"`` an update over ``max_update_norm``.

    A spec is one run's: its algorithm, participation process and channel keep that run's state, so make a new spec
    (with new objects) for every run. When ``num_clients`` is given, per-client settings (local-step lists,
    per-client probabilities of the participation process or the channel) are checked against it here.
    """

    algorithm: Algorithm | None = None
    participation: Participation | None = None
    local_steps: Any = 1
    selection: Any = None
    channel: Any = None
    latency: Any = None
    deadline: float | None = None
    num_clients: int | None = None
    partitioner: Any = None
    engine: str = AUTO
    compile: bool | str | None = None
    seed: int | None = None
    optimizer_state: str = "reset"
    client_weights: str = "uniform"
    max_update_norm: float | None = None
    update_norm_action: str = "reject"

    def __post_init__(self) -> None:
        self._check()
        settle = object.__setattr__  # frozen: the defaults are settled once, here
        if self.algorithm is None:
            settle(self, "algorithm", FedAvg())
        if self.participation is None:
            settle(self, "participation", Full())
        if self.num_clients is not None:
            settle(self, "num_clients", check_int(self.num_clients, "num_clients"))
        if self.compile is None and self.engine != AUTO:
            settle(self, "compile", False)  # None lets engine='auto' decide; an explicit engine compiles only if asked

    def _check(self) -> None:
        """Each setting on its own, then the per-client ones against ``num_clients`` when it is known."""
        check_engine_name(self.engine)
        if isinstance(self.max_update_norm, numbers.Real) and not isinstance(self.max_update_norm, bool):
            # an int beyond the float range is refused here, by name (the server's check would overflow converting it)
            check_real(self.max_update_norm, "max_update_norm", 0.0, math.inf, low_open=True, high_open=True)
        check_server_options(self.optimizer_state, self.client_weights, self.max_update_norm, self.update_norm_action)
        check_engine_options(self.engine, self.compile, self.optimizer_state)  # persist, and the engine's compile
        num_clients = None if self.num_clients is None else check_int(self.num_clients, "num_clients")
        check_local_steps(self.local_steps)
        if self.seed is not None:
            resolve_seed(self.seed)
        check_deadline(self.deadline, self.latency)
        if num_clients is None:
            return
        local_steps_for(self.local_steps, 0, num_clients, 0)
        # Lengths are checked on a copy: the run's own objects are set up once, by the round planner, with the run's
        # seed (setup replaces their per-client arrays, so the copy shares nothing that it changes).
        participation = self.participation
        if participation is not None and not participation.needs_label_hist:
            copy.copy(participation).setup(num_clients, 0)
        if self.channel is not None:
            copy.copy(self.channel).setup(num_clients, 0)

    # ------------------------------------------------------------------ the run
    def run_seed(self) -> int:
        """The seed of every draw: :attr:`seed`, else Lightning's global seed, else 0 (read when the run starts)."""
        return resolve_seed(self.seed)

    def client_streams(self, dataloader: object, datamodule: object, seed: int) -> ClientStreams:
        """Per-client data streams from Lightning's train dataloader (its dataset, batch size, collate function and
        workers) and the clients of ``datamodule`` (a :class:`FederatedDataModule`) or of :attr:`partitioner`."""
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"FedHetStrategy needs the train dataloader to be a torch DataLoader, got {type(dataloader).__name__}"
            )
        dataset = dataloader.dataset
        num_clients = self.num_clients
        if isinstance(datamodule, FederatedDataModule):
            client_indices = datamodule.client_indices
            if num_clients is not None and num_clients != len(client_indices):
                raise ValueError(
                    f"num_clients={num_clients} but the FederatedDataModule holds {len(client_indices)} clients"
                )
        elif self.partitioner is not None:
            client_indices = split_dataset(dataset, self.partitioner, num_clients, seed)
        else:
            raise ValueError(
                "FedHetStrategy does not know how to split the training data: use a FederatedDataModule, or pass "
                "FedHetStrategy(num_clients=..., partitioner=IID() | Dirichlet(alpha) | index lists)"
            )
        batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None) or 1
        return ClientStreams(
            dataset,
            client_indices,
            batch_size=batch_size,
            seed=seed,
            collate_fn=dataloader.collate_fn,
            num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory,
        )

    def build_server(
        self,
        init_vector: torch.Tensor,
        num_parameters: int,
        seed: int,
        *,
        streams: ClientStreams | None = None,
        client_sizes: Sequence[int] | None = None,
        init_ints: torch.Tensor | None = None,
        participation: Participation | None = None,
    ) -> Server:
        """The run's :class:`Server` with global model ``init_vector`` (``[d]``, its first ``num_parameters``
        entries the parameters) and this spec's rule, draws (with ``seed``) and options.

        The clients are ``streams`` (their data, when they train here) or just their ``client_sizes`` (``|D_i|``,
        when they train elsewhere: no batches are drawn). ``participation`` stands in for :attr:`participation` when
        the run wraps it (the Flower bridge intersects it with the connected nodes).
        """
        planner = RoundPlanner(
            participation=self.participation if participation is None else participation,
            algorithm=self.algorithm,
            streams=streams,
            local_steps=self.local_steps,
            selection=self.selection,
            channel=self.channel,
            latency=self.latency,
            deadline=self.deadline,
            seed=seed,
            client_sizes=client_sizes,
        )
        return Server(
            planner,
            self.algorithm,
            init_vector,
            num_parameters,
            client_weights=self.client_weights,
            optimizer_state=self.optimizer_state,
            init_ints=init_ints,
            max_update_norm=self.max_update_norm,
            update_norm_action=self.update_norm_action,
        )


def spec_from_arguments(spec: FederationSpec | None, owner: Callable, settings: dict[str, Any]) -> FederationSpec:
    """The spec a strategy runs: ``spec`` when one is given, else one made of the flat ``settings``.

    ``owner`` is the strategy's ``__init__``: its defaults tell which flat settings were left alone, and a spec
    given together with a flat setting that was not is refused (which one should win is not for us to guess).
    """
    if spec is None:
        return FederationSpec(**settings)
    name = owner.__qualname__.split(".")[0]
    if not isinstance(spec, FederationSpec):
        raise TypeError(f"{name}(spec=...) takes a FederationSpec, got {type(spec).__name__}")
    defaults = inspect.signature(owner).parameters
    given = [key for key, value in settings.items() if not _is_default(value, defaults[key].default)]
    if given:
        raise TypeError(
            f"{name} takes the federation's settings as spec= or as keyword arguments, not both: got spec= and "
            f"{', '.join(given)} (set them in the FederationSpec)"
        )
    return spec


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and isinstance(value, (str, int, float)) and
                                value == default)


class SpecSetting:
    """A read-only attribute of a strategy that shows one setting of its spec (``strategy.local_steps`` is
    ``strategy.spec.local_steps``): the strategies keep the attribute names they always had, the spec holds the
    values, and neither can drift from the other."""

    def __init__(self, setting: str | None = None) -> None:
        self.setting = setting

    def __set_name__(self, owner: type, name: str) -> None:
        if self.setting is None:
            self.setting = name

    def __get__(self, strategy: Any, owner: type | None = None) -> Any:
        return self if strategy is None else getattr(strategy.spec, self.setting)

    def __set__(self, strategy: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.setting} is a setting of the strategy's FederationSpec: make a new strategy with "
            f"spec=dataclasses.replace(strategy.spec, {self.setting}=...)"
        )
