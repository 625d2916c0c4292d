"""Compute heterogeneity: how many local steps each client runs in a round (FedACS paper App. I.3.1).

``local_steps`` may be

- an ``int >= 1``: every client, every round;
- a per-client sequence of ints ``>= 1`` (length ``N``): fixed per client (FedACS's static setting);
- a :class:`StepDistribution`, drawn afresh every round: :class:`UniformSteps` (integer-uniform, inclusive) or
  :class:`TwoGroupSteps` (FedACS's dynamic setting).

:func:`local_steps_for` resolves any of them to ``int64 [N]`` for one round. Random draws come from
``generator(seed, Stream.LOCAL_STEPS, round)``, one per client per round for all ``N`` clients, so a round's
steps are a pure function of ``(seed, round)`` and do not depend on who is selected.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_fedhet._checks import MAX_EXACT_INT, as_int_array, check_int, check_length, check_round, check_seed
from lightning_fedhet.seeding import Stream, generator


class StepDistribution:
    """A per-round random draw of local steps: subclasses implement :meth:`sample` and :meth:`expected`."""

    def sample(self, round: int, num_clients: int, seed: int) -> np.ndarray:
        """Local steps of every client in round ``round``: ``int64 [num_clients]``, all ``>= 1``."""
        raise NotImplementedError

    def expected(self, num_clients: int) -> np.ndarray:
        """Mean local steps of every client (float64 ``[num_clients]``)."""
        raise NotImplementedError

    @staticmethod
    def _rng(round: int, seed: int) -> np.random.Generator:
        return generator(check_seed(seed), Stream.LOCAL_STEPS, check_round(round))


class UniformSteps(StepDistribution):
    """Local steps ``K_i(t) ~ Uniform{low, ..., high}`` (both ends included), independent per client and round.

    Args:
        low: smallest number of steps, integer ``>= 1`` (or a per-client sequence).
        high: largest number of steps, integer ``>= low`` (or a per-client sequence).
    """

    def __init__(self, low: Any, high: Any) -> None:
        self.low = as_int_array(low, "local_steps low")
        self.high = as_int_array(high, "local_steps high")
        try:
            low, high = np.broadcast_arrays(self.low, self.high)
        except ValueError as err:
            raise ValueError(f"local_steps low and high have different lengths ({self.low.shape[0]} and "
                             f"{self.high.shape[0]})") from err
        if np.any(high < low):
            raise ValueError(f"local_steps high must be >= low, got low={self.low.tolist()}, high={self.high.tolist()}")

    def _bounds(self, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
        num_clients = check_int(num_clients, "num_clients")
        low, high = np.broadcast_arrays(self.low, self.high)
        if low.ndim == 1 and low.shape[0] != num_clients:
            raise ValueError(f"local_steps bounds have {low.shape[0]} entries but num_clients is {num_clients}")
        return np.broadcast_to(low, (num_clients,)), np.broadcast_to(high, (num_clients,))

    def sample(self, round: int, num_clients: int, seed: int) -> np.ndarray:
        low, high = self._bounds(num_clients)
        return self._rng(round, seed).integers(low, high, endpoint=True, size=low.shape[0], dtype=np.int64)

    def expected(self, num_clients: int) -> np.ndarray:
        low, high = self._bounds(num_clients)
        return (low.astype(np.float64) + high) / 2.0

    def __repr__(self) -> str:
        def fmt(a: np.ndarray) -> str:
            return str(int(a)) if a.ndim == 0 else f"<{a.shape[0]} per-client values>"

        return f"UniformSteps(low={fmt(self.low)}, high={fmt(self.high)})"


class TwoGroupSteps(UniformSteps):
    """FedACS's dynamic compute heterogeneity (FedACS paper App. I.3.1): two halves with different step ranges.

    Clients ``0 .. N//2 - 1`` (the paper's clients 1-10 of 20) draw ``U{first}`` and the others ``U{second}``,
    afresh every round, integer-uniform with both ends included. Defaults are the paper's ``(1, 10)`` and
    ``(20, 30)``. (FedACS pairs this with per-round link losses ``q ~ U(0.4, 0.5)`` / ``U(0, 0.1)``; that part is
    not modelled here.)

    Args:
        first: ``(low, high)`` of the first half.
        second: ``(low, high)`` of the second half.
    """

    def __init__(self, first: tuple[int, int] = (1, 10), second: tuple[int, int] = (20, 30)) -> None:
        self.first = self._range(first, "first")
        self.second = self._range(second, "second")

    @staticmethod
    def _range(value: Any, name: str) -> tuple[int, int]:
        bounds = as_int_array(value, name)
        if bounds.shape != (2,):
            raise ValueError(f"{name} must be a (low, high) pair of integers >= 1, got {value!r}")
        low, high = int(bounds[0]), int(bounds[1])
        if high < low:
            raise ValueError(f"{name} must be a (low, high) pair with high >= low, got {value!r}")
        return low, high

    def _bounds(self, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
        num_clients = check_int(num_clients, "num_clients")
        first = np.arange(num_clients) < num_clients // 2
        low = np.where(first, self.first[0], self.second[0]).astype(np.int64)
        high = np.where(first, self.first[1], self.second[1]).astype(np.int64)
        return low, high

    def __repr__(self) -> str:
        return f"TwoGroupSteps(first={self.first}, second={self.second})"


def check_local_steps(spec: Any) -> Any:
    """Validate a ``local_steps`` argument early (lengths are checked when ``num_clients`` is known)."""
    if isinstance(spec, StepDistribution):
        return spec
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        steps = check_int(spec, "local_steps")
        if steps > MAX_EXACT_INT:
            raise ValueError(f"local_steps must be an integer <= 2**53, got {spec!r}")
        return steps
    return as_int_array(spec, "local_steps")


def local_steps_for(spec: Any, round: int, num_clients: int, seed: int) -> np.ndarray:
    """Local steps of every client in round ``round`` as ``int64 [num_clients]``.

    Args:
        spec: an int ``>= 1``, a per-client sequence of ints ``>= 1`` or a :class:`StepDistribution`
            (subclass it for another per-round draw; its output is validated).
        round: 0-based round index.
        num_clients: ``N``.
        seed: the run's seed.
    """
    num_clients = check_int(num_clients, "num_clients")
    seed = check_seed(seed)
    if isinstance(spec, StepDistribution):
        steps = as_int_array(spec.sample(round, num_clients, seed), "local_steps")
    else:
        steps = check_local_steps(spec)
    steps = np.asarray(steps, dtype=np.int64)
    if steps.ndim == 0:
        return np.full(num_clients, int(steps), dtype=np.int64)
    check_length(steps.shape[0], num_clients, "local_steps")
    return steps.copy()
