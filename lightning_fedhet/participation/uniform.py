"""Uniform sampling of ``k`` clients without replacement."""

from __future__ import annotations

import numpy as np

from lightning_fedhet._checks import check_int
from lightning_fedhet.participation.base import Participation


class UniformSample(Participation):
    """Exactly ``k`` of the ``N`` clients, uniformly without replacement, each round (``p_i = k/N``).

    Used as ``participation=UniformSample(k)`` it is an availability process. Passed as
    ``FedHetStrategy(selection=UniformSample(k))`` it is a server selection rule: ``k`` clients chosen
    uniformly among those available (all of them when fewer than ``k`` are available).

    Args:
        k: clients per round, ``1 <= k <= N`` (checked at :meth:`setup`).
    """

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = check_int(k, "k")

    def setup(self, num_clients: int, seed: int = 0) -> None:
        super().setup(num_clients, seed)
        if self.k > self.num_clients:
            raise ValueError(f"k must be <= num_clients={self.num_clients}, got k={self.k}")

    def _sample(self, round: int) -> np.ndarray:
        return self.choose(np.ones(self.num_clients, dtype=bool), self.rng(round))

    def choose(self, available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``k`` of the clients in the bool mask ``available`` (all of them if fewer), as a bool mask."""
        available = np.asarray(available, dtype=bool)
        ids = np.flatnonzero(available)
        mask = np.zeros(available.shape[0], dtype=bool)
        if ids.size <= self.k:
            mask[ids] = True
        else:
            mask[rng.choice(ids, size=self.k, replace=False)] = True
        return mask

    def _stationary(self) -> np.ndarray:
        return np.full(self.num_clients, self.k / self.num_clients)

    def __repr__(self) -> str:
        return f"UniformSample(k={self.k})"
