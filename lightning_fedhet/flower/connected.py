"""Availability in a deployment: a client is available when its node is connected (and the process says so)."""

from __future__ import annotations

import numpy as np
from torch import Tensor

from lightning_fedhet.participation.base import Participation


class ConnectedNodes(Participation):
    """``inner``'s availability restricted to the clients whose Flower node is connected this round.

    With ``inner=Full()`` this is the real availability of a deployment; with any other process (``Trace``,
    ``Bernoulli``, ...) a Flower run replays the same availability as the simulation, less the nodes that are
    really gone. :attr:`p` is ``inner``'s (what the rules are told), since real disconnections have no model.

    The strategy calls :meth:`observe` with the connected clients before each round is planned.
    """

    def __init__(self, inner: Participation) -> None:
        super().__init__()
        self.inner = inner
        self.connected: np.ndarray | None = None

    @property
    def needs_label_hist(self) -> bool:
        return self.inner.needs_label_hist

    def setup(self, num_clients: int, seed: int = 0) -> None:
        super().setup(num_clients, seed)
        self.inner.setup(num_clients, seed)
        self.connected = np.ones(num_clients, dtype=bool)

    def observe(self, connected: Tensor) -> None:
        """The clients whose node is connected now, ``bool [N]``."""
        self._check_setup()
        if tuple(connected.shape) != (self.num_clients,):
            raise ValueError(f"connected must have shape [{self.num_clients}], got {tuple(connected.shape)}")
        self.connected = connected.numpy().astype(bool)

    def _sample(self, round: int) -> np.ndarray:
        return self.inner.sample(round).numpy() & self.connected

    def _stationary(self) -> np.ndarray:
        return self.inner.p.numpy()

    def __repr__(self) -> str:
        return f"ConnectedNodes({self.inner!r})"
