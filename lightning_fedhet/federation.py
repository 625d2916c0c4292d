"""The per-round plan (DESIGN.md §2.1): availability -> selection -> downlink -> local steps -> uplink.

Everything here is decided before any client trains, from generators seeded by ``(seed, round)``, so
a plan is reproducible and independent of how (or whether) the cohort is then executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet.algorithms.base import Algorithm, RoundContext
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.seeding import Stream, generator


def resolve_local_steps(local_steps, round: int, num_clients: int, seed: int) -> np.ndarray:
    """Local steps of every client in round ``round`` as int64 ``[N]``.

    ``local_steps`` is an int, a per-client sequence of ints, or an object with
    ``sample(round, num_clients, seed) -> int[N]`` (per-round random draws).
    """
    if hasattr(local_steps, "sample"):
        steps = np.asarray(local_steps.sample(round, num_clients, seed))
    elif np.ndim(local_steps) == 0:
        steps = np.full(num_clients, local_steps)
    else:
        steps = np.asarray(local_steps)
        if steps.shape != (num_clients,):
            raise ValueError(f"local_steps has {steps.size} entries, expected num_clients={num_clients}")
    if not np.all(np.equal(np.mod(steps, 1), 0)) or steps.min() < 1:
        raise ValueError(f"local_steps must be integers >= 1, got min {steps.min()}")
    return steps.astype(np.int64)


@dataclass
class RoundPlan:
    """What happens in one round, decided up front. Masks are ``torch.bool [N]``.

    Attributes:
        available: clients the participation process made available.
        selected: clients the server asked to train.
        trained: selected clients that received the model (downlink) and hold data.
        arrives: trained clients whose update will reach the server (uplink).
        local_steps: int64 ``[N]``; steps each trained client runs (0 for the others).
        schedule: ``(client, local step)`` for every mini-batch of the round, clients in id order.
        batches: dataset indices of each mini-batch of ``schedule``.
    """

    round: int
    available: Tensor
    selected: Tensor
    trained: Tensor
    arrives: Tensor
    local_steps: np.ndarray
    schedule: list[tuple[int, int]] = field(default_factory=list)
    batches: list[np.ndarray] = field(default_factory=list)

    @property
    def trained_ids(self) -> list[int]:
        return torch.nonzero(self.trained).flatten().tolist()


class Federation:
    """Draws the plan of each round. Framework-free: the strategy executes the plan.

    Args:
        participation: availability process (set up by this class).
        algorithm: server rule; its ``select`` is used when ``selection`` is None.
        streams: per-client data streams.
        local_steps: int, per-client array or per-round draw (see :func:`resolve_local_steps`).
        selection: optional selector with ``choose(available, rng) -> bool[N]`` (e.g. ``UniformSample(k)``).
        channel: optional lossy channel with ``downlink(round, mask)`` / ``uplink(round, mask)``.
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
        seed: int = 0,
    ) -> None:
        self.participation = participation
        self.algorithm = algorithm
        self.streams = streams
        self.local_steps = local_steps
        self.selection = selection
        self.channel = channel
        self.seed = int(seed)
        self.num_clients = streams.num_clients
        participation.setup(self.num_clients, self.seed)
        if selection is not None:
            if not hasattr(selection, "choose"):
                raise TypeError(f"selection must have a choose(available, rng) method, got {type(selection).__name__}")
            selection.setup(self.num_clients, self.seed)
        if channel is not None:
            channel.setup(self.num_clients, self.seed)
        resolve_local_steps(local_steps, 0, self.num_clients, self.seed)  # validate early
        self.has_data = torch.from_numpy(streams.sizes > 0)

    def plan(self, round: int) -> RoundPlan:
        available = self.participation.sample(round)
        rng = generator(self.seed, Stream.SELECTION, round)
        if self.selection is not None:
            selected = torch.from_numpy(self.selection.choose(available.numpy(), rng))
        else:
            selected = torch.as_tensor(self.algorithm.select(round, available, rng))
            if selected.dtype != torch.bool:
                selected = selected > 0
        received_model = self.channel.downlink(round, selected) if self.channel is not None else selected.clone()
        trained = received_model & self.has_data
        arrives = self.channel.uplink(round, trained) if self.channel is not None else trained.clone()
        steps = resolve_local_steps(self.local_steps, round, self.num_clients, self.seed)
        steps = np.where(trained.numpy(), steps, 0)
        plan = RoundPlan(round, available, selected, trained, arrives & trained, steps)
        for client in plan.trained_ids:
            k = int(steps[client])
            plan.schedule += [(client, step) for step in range(k)]
            plan.batches += self.streams.batch_indices(round, client, k)
        return plan

    @property
    def participation_probs(self) -> Tensor | None:
        """Probability that each client is selected in a round (``None`` when there is no closed form)."""
        p = self.participation.p
        if self.selection is None:
            return p
        if bool((p == 1).all()) and hasattr(self.selection, "k"):
            return torch.full((self.num_clients,), self.selection.k / self.num_clients, dtype=torch.float64)
        return None

    def context(self, plan: RoundPlan) -> RoundContext:
        """What the server knows when it opens the round."""
        success = getattr(self.channel, "success_probs", None) if self.channel is not None else None
        return RoundContext(
            round=plan.round,
            num_clients=self.num_clients,
            available=plan.available,
            selected=plan.selected,
            received=plan.arrives,
            participation_probs=self.participation_probs,
            success_probs=success,
            local_steps=torch.from_numpy(plan.local_steps),
        )
