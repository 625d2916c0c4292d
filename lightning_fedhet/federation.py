"""The per-round plan: availability -> selection -> downlink -> local steps -> uplink.

Everything here is decided before any client trains, from generators seeded by ``(seed, round)``, so
a plan is reproducible and independent of how (or whether) the cohort is then executed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_int
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
        batches: dataset indices of each mini-batch of ``schedule`` (none when the clients train elsewhere).
        aggregation_probs: float64 ``[N]``, probability that each client's update is aggregated this round
            (see :meth:`RoundPlanner.aggregation_probs`), or ``None`` without a closed form.
        success_probs: float64 ``[N]``, probability that a selected client's update arrives this round (links and
            deadline, at the client's local steps of this round; see :meth:`RoundPlanner.success_probs`), or
            ``None`` without a channel and a deadline.
        availability_probs: float64 ``[N]``, probability that each client is available this round.
        selection_counts: int64 ``[N]``, how many times the rule's own sampler drew each client (``None`` when the
            selection is a set); ``selected`` is ``selection_counts > 0``.
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
    success_probs: Tensor | None = None
    availability_probs: Tensor | None = None
    selection_counts: Tensor | None = None
    # (mask, its version, its ids): trained_ids of the current `trained` mask, kept for the next read
    _trained_ids: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def trained_ids(self) -> list[int]:
        """The trained clients' ids, increasing. Computed once per mask (a new mask, or the mask changed in place,
        computes them again): a round reads them several times, and each read was a pass over all ``N`` clients."""
        cached = self._trained_ids
        if cached is None or cached[0] is not self.trained or cached[1] != self.trained._version:
            cached = self._trained_ids = (self.trained, self.trained._version, mask_ids(self.trained).tolist())
        return list(cached[2])

    @property
    def num_steps(self) -> int:
        """Mini-batches in the round (all clients' local steps)."""
        return len(self.schedule)


def mask_ids(mask: Tensor) -> Tensor:
    """The indices of a bool mask ``[N]``, increasing, int64 (through numpy on a CPU: ``torch.nonzero`` took about 20
    ms for a million clients on a 2-core CPU, ``np.flatnonzero`` about 1 ms)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy())).to(torch.int64)
    return torch.nonzero(mask).flatten().to(torch.int64)


class RoundPlanner:
    """Draws the plan of each round. Framework-free: the server owns the plan, an engine executes it.

    Args:
        participation: availability process (set up by this class).
        algorithm: server rule; its ``select`` is used when ``selection`` is None.
        streams: per-client data streams; ``None`` when the clients train elsewhere (then ``client_sizes`` gives
            their sizes and plans draw no batches).
        local_steps: int, per-client array or per-round draw (see :func:`resolve_local_steps`).
        selection: optional selector with ``choose(available, rng) -> bool[N]`` (e.g. ``UniformSample(k)``).
        channel: optional lossy channel with ``downlink(round, mask)`` / ``uplink(round, mask)``.
        latency: optional latency model with ``sample(round, mask, local_steps) -> seconds[N]``.
        deadline: optional per-round deadline in simulated seconds; later clients' updates are dropped.
        seed: seed of every draw.
        client_sizes: ``|D_i|`` of each client when there are no ``streams``.
    """

    def __init__(
        self,
        participation: Participation,
        algorithm: Algorithm,
        streams: ClientStreams | None = None,
        local_steps=1,
        selection=None,
        channel=None,
        latency=None,
        deadline: float | None = None,
        seed: int = 0,
        client_sizes: Sequence[int] | None = None,
    ) -> None:
        if (streams is None) == (client_sizes is None):
            raise ValueError("RoundPlanner takes the clients' streams or their client_sizes (exactly one of them)")
        if streams is None:
            sizes = np.array([check_int(n, "client_sizes", 0) for n in client_sizes], dtype=np.int64)
            sizes.flags.writeable = False
        else:
            sizes = streams.sizes
        self.participation = participation
        self.algorithm = algorithm
        self.streams = streams
        #: ``|D_i|`` of each client, int64 ``[N]`` (read-only)
        self.client_sizes = sizes
        self.local_steps = local_steps
        self.selection = selection
        self.channel = channel
        self.latency = latency
        self.clock = VirtualClock(deadline)
        check_deadline(deadline, latency)
        self.seed = int(seed)
        self.num_clients = len(sizes)
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
        self.has_data = torch.from_numpy(sizes > 0)

    def plan(self, round: int, probe: Callable[[int, Tensor], Tensor] | None = None) -> RoundPlan:
        """Draw round ``round``'s plan.

        Args:
            round: 0-based round index.
            probe: ``probe(round, available) -> losses float64 [N]`` (NaN where not available): the one-batch
                loss of every available client at the current global model, computed by the engine. Called only
                when the algorithm asks for it (CA-Fed's ``loss_source="probe"``, thesis Algorithm 3 line 3).
        """
        available = self.participation.sample(round)
        # The selection stream, for a strategy-level selection or a rule that selects itself; the default select keeps
        # every available client and draws nothing (building a generator costs about 15 us a round)
        draws = self.selection is not None or type(self.algorithm).select is not Algorithm.select
        rng = generator(self.seed, Stream.SELECTION, round) if draws else None
        steps = local_steps_for(self.local_steps, round, self.num_clients, self.seed)
        # P(arrival | selected) at the steps every client would run this round: links and deadline
        success = self.success_probs(round, steps)
        availability = self.availability_probs(round)
        # The "system oracle" of FedACS-style samplers: this round's link reliability and local work, and each
        # client's availability (the samplers' pi_m).
        self.algorithm.observe_system(
            round,
            success_probs=success,
            local_steps=torch.from_numpy(steps),
            participation_probs=availability,
        )
        if self.algorithm.wants_probe_losses():
            if probe is None:
                raise RuntimeError(f"{type(self.algorithm).__name__} needs probe losses but no engine provides them")
            self.algorithm.observe_losses(round, probe(round, available))
        counts = None
        if self.selection is not None:
            selected = torch.from_numpy(self.selection.choose(available.numpy(), rng))
        else:
            selected = torch.as_tensor(self.algorithm.select(round, available, rng))
            if selected.dtype != torch.bool:
                counts = selected.to(torch.int64)  # a sampler with replacement: draws per client
                selected = counts > 0
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
        plan.success_probs, plan.availability_probs, plan.selection_counts = success, availability, counts
        plan.aggregation_probs = self._aggregation_probs(round, success)
        trained_ids = plan.trained_ids
        for client in trained_ids:
            plan.schedule += [(client, step) for step in range(int(steps[client]))]
        if self.streams is not None:
            for own in self.streams.round_batch_indices(round, trained_ids, steps[trained_ids]):
                plan.batches += own
        return plan

    def label_histograms(self) -> np.ndarray:
        """Per-client label counts ``[N, C]`` (for label-correlated participation recipes)."""
        if self.streams is None:
            raise ValueError(
                "this participation recipe needs the clients' labels, but the server knows only their sizes"
            )
        labels = dataset_labels(self.streams.dataset)
        if labels is None:
            raise ValueError("this participation recipe needs labels, but the training dataset exposes none")
        classes, codes = np.unique(labels, return_inverse=True)
        hist = np.zeros((self.num_clients, len(classes)), dtype=np.int64)
        for i, idx in enumerate(self.streams.client_indices):
            hist[i] = np.bincount(codes[idx], minlength=len(classes))
        return hist

    def availability_probs(self, round: int) -> Tensor:
        """Probability that each client is available in round ``round``, float64 ``[N]`` (the participation
        process's marginal of that round; its stationary ``p`` for a stationary process)."""
        return self.participation.marginal_probs(round).to(torch.float64)

    def selection_probs(self, round: int) -> Tensor | None:
        """Probability that each client is selected in round ``round``: ``P(available) x P(selected | available)``,
        float64 ``[N]``, or ``None`` when there is no closed form.

        ``P(selected | available)`` is 1 when every available client is kept, ``k/N`` for a strategy-level
        ``UniformSample(k)`` over always-available clients (no closed form otherwise), and the rule's own
        :meth:`~lightning_fedhet.algorithms.base.Algorithm.selection_probs` for rules that select themselves.
        """
        p = self.availability_probs(round)
        if self.selection is not None:
            if bool((p == 1).all()):
                return torch.full((self.num_clients,), self.selection.k / self.num_clients, dtype=torch.float64)
            return None
        given = self.algorithm.selection_probs(round)
        if given is None:
            return None
        return p * torch.as_tensor(given, dtype=torch.float64)

    def success_probs(self, round: int, local_steps=None) -> Tensor | None:
        """Probability that a selected client's update reaches the server in round ``round``, float64 ``[N]``:
        ``P(downlink) x P(uplink) x P(on time | K_i(t))``, where the last factor (a deadline's) is evaluated at
        ``local_steps`` (int ``[N]``; default this round's draw for every client, which the plan uses). ``None``
        without a channel and without a deadline (every selected client's update arrives)."""
        probs = None
        if self.channel is not None:
            probs = self.channel.success_probs_at(round).to(torch.float64)
        if self.latency is not None and self.clock.deadline is not None:
            if local_steps is None:
                local_steps = local_steps_for(self.local_steps, round, self.num_clients, self.seed)
            steps = np.maximum(np.asarray(local_steps, dtype=np.int64), 1)
            on_time = torch.as_tensor(self.latency.on_time_probs(self.clock.deadline, steps), dtype=torch.float64)
            probs = on_time if probs is None else probs * on_time
        return probs

    def aggregation_probs(self, round: int, local_steps: np.ndarray) -> Tensor | None:
        """Probability that each client's update is *aggregated* in round ``round``, float64 ``[N]``.

        ``P(available) x P(selected | available) x P(downlink) x P(uplink) x P(on time | K_i(t))``: what the
        unbiased ``1/p_i`` weights of FedAvg(known_p), FedVARP/FedStale(known_p), UPGA-PL(q="known") and Fed-CIS
        (correct_participation) must divide by. A lossy link or a deadline makes it smaller than the availability
        probability; dividing by the latter would bias the update towards the clients with reliable links.
        ``None`` when the selection probability has no closed form.
        """
        return self._aggregation_probs(round, self.success_probs(round, local_steps))

    def _aggregation_probs(self, round: int, success: Tensor | None) -> Tensor | None:
        p = self.selection_probs(round)
        if p is None:
            return None
        return p if success is None else p * success

    def context(self, plan: RoundPlan) -> RoundContext:
        """What the server knows when it opens the round."""
        return RoundContext(
            round=plan.round,
            num_clients=self.num_clients,
            available=plan.available,
            selected=plan.selected if plan.selection_counts is None else plan.selection_counts,
            received=plan.arrives,
            participation_probs=plan.aggregation_probs,
            success_probs=plan.success_probs,
            local_steps=torch.from_numpy(plan.local_steps),
            availability_probs=plan.availability_probs,
        )


def check_deadline(deadline: float | None, latency) -> None:
    """A deadline is measured on the latency model's clock: refuse one without it."""
    if deadline is not None and latency is None:
        raise ValueError("deadline needs a latency model (latency=ShiftedExponential(...))")


Federation = RoundPlanner  # the name of earlier releases
