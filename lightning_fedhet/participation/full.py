"""Full participation: every client is available every round."""

from __future__ import annotations

import numpy as np

from lightning_fedhet.participation.base import Participation


class Full(Participation):
    """All ``N`` clients are available in every round (``p_i = 1``)."""

    def _sample(self, round: int) -> np.ndarray:
        return np.ones(self.num_clients, dtype=bool)

    def _stationary(self) -> np.ndarray:
        return np.ones(self.num_clients)
