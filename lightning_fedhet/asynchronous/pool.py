"""Client pools: which client a local-training request goes to, and which clients a Sync-ST round may use.

Two pools:

- :class:`CappedPool` (the default, the FedAST paper's): every request draws its client uniformly from all ``N``
  clients. At most ``fraction * N`` *distinct* clients may hold requests at once ("30 % available", paper §5.1,
  as the authors' code implements it): a request whose drawn client is idle while the cap is reached is
  **skipped**, not queued and not redrawn (the server tops the task up at its next arrival). A busy client may
  take more requests; they wait in its queue, first come, first served. Sync-ST rounds use ``fraction * N``
  clients drawn uniformly without replacement (a prefix of a random permutation), busy ones included.
- :class:`AvailabilityPool` (an option): an availability process decides who accepts requests, slot by slot
  (``participation.sample(floor(t / slot))``); a request draws uniformly among the available clients, and when
  nobody is available it **waits** for the start of the next slot with someone available. Sync-ST round ``r``
  uses ``participation.sample(r)``. Nothing is ever skipped; under scarcity this delays only the asynchronous
  method (a synchronous round simply has fewer clients).

Every draw is counter-based: a request's client comes from ``generator(seed, Stream.REQUEST_CLIENT, key)`` with
``key`` the server's draw counter, so a resumed server draws exactly as an uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from torch import Tensor

from lightning_fedhet._checks import check_real
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.seeding import Stream, generator

#: How many empty availability slots a request waits before the run is declared stuck (AvailabilityPool).
MAX_WAIT = 100_000


class ClientPool:
    """Protocol of a client pool (see the module doc). ``setup`` first; both methods are pure functions of
    ``(seed, arguments)``."""

    def setup(self, num_clients: int, seed: int = 0) -> None:
        """Size the pool (``num_clients >= 1``) and fix its seed."""
        raise NotImplementedError

    def assign(self, time: float, busy_until: np.ndarray, key: int) -> tuple[int | None, float]:
        """The client of a request created at ``time`` (seconds) and when it is sent.

        Args:
            time: the server's clock.
            busy_until: ``[N]`` float seconds, when each client's queue empties (``> time``: busy).
            key: the draw counter (unique per call).

        Returns:
            ``(client, sent_at)``; ``client`` is None when the request is skipped.
        """
        raise NotImplementedError

    def round_clients(self, round: int) -> np.ndarray:
        """``bool[N]``: the clients a Sync-ST round ``round`` may use."""
        raise NotImplementedError


class CappedPool(ClientPool):
    """The FedAST paper's pool: uniform draws over all clients, at most ``fraction`` of them busy at once.

    Args:
        fraction: the cap on distinct busy clients as a fraction of ``N``, in ``(0, 1]`` (paper: 0.3, i.e. 300 of
            1,000); the cap is ``max(1, round(fraction * N))``.

    Example (``N = 10``, cap 3)::

        pool = CappedPool(0.3); pool.setup(10, seed=0)
        busy = np.array([5., 5., 5., 0, 0, 0, 0, 0, 0, 0])     # clients 0-2 busy until t = 5
        pool.assign(1.0, busy, key)   # (c, 1.0) if the draw c is 0, 1 or 2 (queued), else (None, 1.0): skipped
    """

    def __init__(self, fraction: float = 0.3) -> None:
        self.fraction = check_real(fraction, "fraction", 0.0, 1.0, low_open=True)
        self.num_clients = 0
        self.cap = 0
        self.seed = 0

    def setup(self, num_clients: int, seed: int = 0) -> None:
        self.num_clients = int(num_clients)
        self.cap = max(1, math.floor(self.fraction * self.num_clients + 0.5))
        self.seed = int(seed)

    def assign(self, time: float, busy_until: np.ndarray, key: int) -> tuple[int | None, float]:
        client = int(generator(self.seed, Stream.REQUEST_CLIENT, key).integers(self.num_clients))
        if busy_until[client] > time:
            return client, time  # a busy client queues it, whatever the cap
        if int(np.count_nonzero(busy_until > time)) >= self.cap:
            return None, time  # an idle client while the cap is reached: skipped
        return client, time

    def round_clients(self, round: int) -> np.ndarray:
        mask = np.zeros(self.num_clients, dtype=bool)
        mask[generator(self.seed, Stream.PARTICIPATION, round).permutation(self.num_clients)[: self.cap]] = True
        return mask

    def __repr__(self) -> str:
        return f"CappedPool(fraction={self.fraction:g})"


class AvailabilityPool(ClientPool):
    """Availability by time slots; requests wait for an available client (never skipped).

    Args:
        participation: the availability process (``Bernoulli(0.3)``, ``Trace(mask)``, ...): slot ``s`` covers
            ``[s * slot, (s + 1) * slot)`` seconds, ``participation.sample(s)`` its available clients.
        slot: seconds per availability slot, ``> 0``.
    """

    def __init__(self, participation: Participation, slot: float = 1.0) -> None:
        if not isinstance(participation, Participation):
            raise TypeError(f"participation must be a Participation process, got {type(participation).__name__}")
        self.participation = participation
        self.slot = check_real(slot, "slot", 0.0, math.inf, low_open=True, high_open=True)
        self.seed = 0
        self._cache: tuple[int, np.ndarray] | None = None

    def setup(self, num_clients: int, seed: int = 0) -> None:
        self.participation.setup(int(num_clients), int(seed))
        self.seed = int(seed)
        self._cache = None

    def _ids(self, slot: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != slot:
            self._cache = (slot, np.flatnonzero(_as_numpy(self.participation.sample(slot))))
        return self._cache[1]

    def assign(self, time: float, busy_until: np.ndarray, key: int) -> tuple[int | None, float]:
        first = int(time // self.slot)
        for slot in range(first, first + MAX_WAIT):
            ids = self._ids(slot)
            if ids.size:
                sent_at = time if slot == first else slot * self.slot
                return int(ids[generator(self.seed, Stream.REQUEST_CLIENT, key).integers(ids.size)]), sent_at
        raise RuntimeError(f"no client was available in {MAX_WAIT} slots of {self.slot:g} s after t={time:g} s")

    def round_clients(self, round: int) -> np.ndarray:
        return _as_numpy(self.participation.sample(round)).astype(bool)

    def __repr__(self) -> str:
        return f"AvailabilityPool({self.participation!r}, slot={self.slot:g})"


def _as_numpy(mask: Any) -> np.ndarray:
    return mask.numpy() if isinstance(mask, Tensor) else np.asarray(mask)


def resolve_pool(pool: ClientPool | None, participation: Participation | None, slot: float = 1.0) -> ClientPool:
    """The pool a server uses: ``pool``; else ``AvailabilityPool(participation, slot)`` when an availability
    process is given; else the paper's ``CappedPool(0.3)``. Giving both ``pool`` and ``participation`` is an
    error (two owners of one decision)."""
    if pool is not None and participation is not None:
        raise ValueError("give either pool=... or participation=... (which builds AvailabilityPool(participation, "
                         "slot)), not both")
    if pool is not None:
        if not isinstance(pool, ClientPool):
            raise TypeError(f"pool must be a ClientPool (CappedPool, AvailabilityPool), got {type(pool).__name__}")
        return pool
    if participation is not None:
        return AvailabilityPool(participation, slot)
    return CappedPool()
