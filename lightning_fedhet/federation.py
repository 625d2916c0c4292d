"""The per-round plan: availability -> selection -> downlink -> local steps -> uplink.

Everything here is decided before any client trains, from generators seeded by ``(seed, round)``, so
a plan is reproducible and independent of how (or whether) the cohort is then executed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet.algorithms.base import Algorithm, RoundContext
from lightning_fedhet.data.datamodule import dataset_labels
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.participation.uniform import UniformSample
from lightning_fedhet.seeding import Stream, generator
from lightning_fedhet.system.latency import VirtualClock
from lightning_fedhet.system.steps import check_local_steps, local_steps_for


@dataclass
class RoundPlan:
    """What happens in one round, decided up front. Masks are ``torch.bool [N]``.

    Attributes:
        available: clients the participation process made available.
        selected: clients the server asked to train.
        trained: selected clients that received the model (downlink) and hold data.
        arrives: trained clients whose update will reach the server (uplink, and deadline if one is set).
        local_steps: int64 ``[N]``; steps each trained client runs (0 for the others).
        duration: simulated seconds the round takes (0 without a latency model): the slowest arrived update,
            or the deadline when a trained client missed it.
        schedule: ``(client, local step)`` for every mini-batch of the round, clients in id order.
        batches: dataset indices of each mini-batch of ``schedule``.
        aggregation_probs: float64 ``[N]``, probability that each client's update is aggregated this round
            (see :meth:`RoundPlanner.aggregation_probs`), or ``None`` without a closed form.
    """

    round: int
    available: Tensor
    selected: Tensor
    trained: Tensor
    arrives: Tensor
    local_steps: np.ndarray
    duration: float = 0.0
    schedule: list[tuple[int, int]] = field(default_factory=list)
    batches: list[np.ndarray] = field(default_factory=list)
    aggregation_probs: Tensor | None = None

    @property
    def trained_ids(self) -> list[int]:
        return torch.nonzero(self.trained).flatten().tolist()

    @property
    def num_steps(self) -> int:
        """Mini-batches in the round (all clients' local steps)."""
        return len(self.schedule)


class RoundPlanner:
    """Draws the plan of each round. Framework-free: the server owns the plan, an engine executes it.

    Args:
        participation: availability process (set up by this class).
        algorithm: server rule; its ``select`` is used when ``selection`` is None.
        streams: per-client data streams.
        local_steps: int, per-client array or per-round draw (see :func:`resolve_local_steps`).
        selection: optional selector with ``choose(available, rng) -> bool[N]`` (e.g. ``UniformSample(k)``).
        channel: optional lossy channel with ``downlink(round, mask)`` / ``uplink(round, mask)``.
        latency: optional latency model with ``sample(round, mask, local_steps) -> seconds[N]``.
        deadline: optional per-round deadline in simulated seconds; later clients' updates are dropped.
        seed: seed of every draw.
    """

    def __init__(
        self,
        participation: Participation,
        algorithm: Algorithm,
        streams: ClientStreams,
        local_steps=1,
        selection=None,
        channel=None,
        latency=None,
        deadline: float | None = None,
        seed: int = 0,
    ) -> None:
        self.participation = participation
        self.algorithm = algorithm
        self.streams = streams
        self.local_steps = local_steps
        self.selection = selection
        self.channel = channel
        self.latency = latency
        self.clock = VirtualClock(deadline)
        if deadline is not None and latency is None:
            raise ValueError("deadline needs a latency model (latency=ShiftedExponential(...))")
        self.seed = int(seed)
        self.num_clients = streams.num_clients
        if participation.needs_label_hist:
            participation.setup(self.num_clients, self.seed, label_hist=self.label_histograms())
        else:
            participation.setup(self.num_clients, self.seed)
        if selection is not None:
            if not isinstance(selection, UniformSample):
                raise TypeError(f"selection must be a UniformSample(k), got {type(selection).__name__}")
            if algorithm.selects_clients:
                raise ValueError(
                    f"selection={selection!r} conflicts with {type(algorithm).__name__}, which selects clients itself: "
                    "drop selection= (one owner per decision)"
                )
            selection.setup(self.num_clients, self.seed)
        if channel is not None:
            channel.setup(self.num_clients, self.seed)
        if latency is not None:
            latency.setup(self.num_clients, self.seed)
        check_local_steps(local_steps)
        local_steps_for(local_steps, 0, self.num_clients, self.seed)  # validate lengths early
        self.has_data = torch.from_numpy(streams.sizes > 0)

    def plan(self, round: int, probe: Callable[[int, Tensor], Tensor] | None = None) -> RoundPlan:
        """Draw round ``round``'s plan.

        Args:
            round: 0-based round index.
            probe: ``probe(round, available) -> losses float64 [N]`` (NaN where not available): the one-batch
                loss of every available client at the current global model, computed by the engine. Called only
                when the algorithm asks for it (CA-Fed's ``loss_source="probe"``, thesis Algorithm 3 line 3).
        """
        available = self.participation.sample(round)
        rng = generator(self.seed, Stream.SELECTION, round)
        steps = local_steps_for(self.local_steps, round, self.num_clients, self.seed)
        # The "system oracle" of FedACS-style samplers: this round's link reliability and local work.
        self.algorithm.observe_system(
            round,
            success_probs=self.success_probs(round),
            local_steps=torch.from_numpy(steps),
            participation_probs=self.selection_probs,
        )
        if self.algorithm.wants_probe_losses():
            if probe is None:
                raise RuntimeError(f"{type(self.algorithm).__name__} needs probe losses but no engine provides them")
            self.algorithm.observe_losses(round, probe(round, available))
        if self.selection is not None:
            selected = torch.from_numpy(self.selection.choose(available.numpy(), rng))
        else:
            selected = torch.as_tensor(self.algorithm.select(round, available, rng))
            if selected.dtype != torch.bool:
                selected = selected > 0
        received_model = self.channel.downlink(round, selected) if self.channel is not None else selected.clone()
        trained = received_model & self.has_data
        arrives = self.channel.uplink(round, trained) if self.channel is not None else trained.clone()
        steps = np.where(trained.numpy(), steps, 0)
        duration = 0.0
        if self.latency is not None:
            times = self.latency.sample(round, trained, np.maximum(steps, 1))
            on_time = torch.from_numpy(self.clock.on_time(times, trained))
            late = bool((trained & ~on_time).any())
            arrives = arrives & on_time
            # The round ends when the slowest arriving update is in, or at the deadline if the server had to
            # wait for late clients; a lost upload does not keep the server waiting. With no arrival at all
            # (and no deadline) the server is taken to wait for the slowest trained client.
            waited_for = arrives if bool(arrives.any()) and not late else trained
            duration = self.clock.round_duration(times, waited_for)
        plan = RoundPlan(round, available, selected, trained, arrives & trained, steps, duration)
        plan.aggregation_probs = self.aggregation_probs(round, steps)
        for client in plan.trained_ids:
            k = int(steps[client])
            plan.schedule += [(client, step) for step in range(k)]
            plan.batches += self.streams.batch_indices(round, client, k)
        return plan

    def label_histograms(self) -> np.ndarray:
        """Per-client label counts ``[N, C]`` (for label-correlated participation recipes)."""
        labels = dataset_labels(self.streams.dataset)
        if labels is None:
            raise ValueError("this participation recipe needs labels, but the training dataset exposes none")
        classes, codes = np.unique(labels, return_inverse=True)
        hist = np.zeros((self.num_clients, len(classes)), dtype=np.int64)
        for i, idx in enumerate(self.streams.client_indices):
            hist[i] = np.bincount(codes[idx], minlength=len(classes))
        return hist

    @property
    def selection_probs(self) -> Tensor | None:
        """Probability that each client is selected in a round (``None`` when there is no closed form).

        Rules with their own sampler (FedACS, CA-Fed, ...) know their own selection probabilities; for them this
        is the availability probability ``p_i``.
        """
        p = self.participation.p
        if self.selection is None:
            return p
        if bool((p == 1).all()):
            return torch.full((self.num_clients,), self.selection.k / self.num_clients, dtype=torch.float64)
        return None

    def success_probs(self, round: int) -> Tensor | None:
        """The channel's per-client success probability in round ``round`` (None without a channel)."""
        if self.channel is None:
            return None
        return self.channel.success_probs_at(round)

    def aggregation_probs(self, round: int, local_steps: np.ndarray) -> Tensor | None:
        """Probability that each client's update is *aggregated* in round ``round``, float64 ``[N]``.

        ``P(selected) x P(downlink) x P(uplink) x P(on time | K_i(t))``: what the unbiased ``1/p_i`` weights of
        FedAvg(known_p), FedVARP/FedStale(known_p) must divide by. A lossy link or a deadline makes it smaller
        than the availability probability; dividing by the latter would bias the update towards the clients with
        reliable links. ``None`` when the selection probability has no closed form.
        """
        p = self.selection_probs
        if p is None:
            return None
        p = p.to(torch.float64).clone()
        success = self.success_probs(round)
        if success is not None:
            p = p * success.to(torch.float64)
        if self.latency is not None and self.clock.deadline is not None:
            on_time = self.latency.on_time_probs(self.clock.deadline, np.maximum(local_steps, 1))
            p = p * torch.as_tensor(on_time, dtype=torch.float64)
        return p

    def context(self, plan: RoundPlan) -> RoundContext:
        """What the server knows when it opens the round."""
        success = self.success_probs(plan.round)
        return RoundContext(
            round=plan.round,
            num_clients=self.num_clients,
            available=plan.available,
            selected=plan.selected,
            received=plan.arrives,
            participation_probs=plan.aggregation_probs,
            success_probs=success,
            local_steps=torch.from_numpy(plan.local_steps),
        )


Federation = RoundPlanner  # the name of earlier releases
