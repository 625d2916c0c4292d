"""The availability-process protocol: ``setup(num_clients, seed)``, ``sample(round)``, ``p``."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_int, check_round, check_seed
from lightning_fedhet.seeding import Stream, generator


class Participation:
    """Which clients are available in round ``t``; not controllable by the server.

    Subclasses implement :meth:`_sample` (numpy, vectorised over clients) and :meth:`_stationary`.
    ``sample(t)`` must be a pure function of ``(seed, t)`` so rounds can be drawn in any order and a
    resumed run sees the same masks.

    Usage::

        proc = Full()
        proc.setup(num_clients=100, seed=0)
        mask = proc.sample(0)     # torch.bool [100]
        proc.p                    # torch.float64 [100], stationary participation probabilities
    """

    def __init__(self) -> None:
        self.num_clients: int = 0
        self.seed: int = 0

    def setup(self, num_clients: int, seed: int = 0) -> None:
        self.num_clients = check_int(num_clients, "num_clients")
        self.seed = check_seed(seed)

    def _check_setup(self) -> None:
        if self.num_clients < 1:
            raise RuntimeError(f"{type(self).__name__}.setup(num_clients, seed) must be called first")

    @property
    def needs_label_hist(self) -> bool:
        """Whether :meth:`setup` must be given ``label_hist=`` (per-client label counts ``[N, C]``)."""
        return False

    def rng(self, round: int) -> np.random.Generator:
        return generator(self.seed, Stream.PARTICIPATION, round)

    def sample(self, round: int) -> Tensor:
        """Availability mask of round ``round`` (0-based): ``torch.bool`` of shape ``[N]``."""
        self._check_setup()
        check_round(round)
        return torch.from_numpy(np.ascontiguousarray(self._sample(int(round)), dtype=bool))

    @property
    def p(self) -> Tensor:
        """Stationary participation probability of each client, ``torch.float64`` of shape ``[N]``."""
        self._check_setup()
        return torch.as_tensor(self._stationary(), dtype=torch.float64)

    def marginal_probs(self, round: int) -> Tensor:
        """``P(client i is available in round round)``, float64 ``[N]``: what a server that knows the process
        divides by. Equal to :attr:`p` for a process that is stationary from round 0 (the default); processes whose
        first rounds are not (``Cyclic(offset="inactive")``) override it."""
        check_round(round)
        return self.p

    def _sample(self, round: int) -> np.ndarray:
        raise NotImplementedError

    def _stationary(self) -> np.ndarray:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
