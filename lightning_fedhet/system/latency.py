"""Per-client round-trip latency and a virtual clock, so runs can report simulated time to accuracy.

The latency model is FedAST's (paper App. C.6 and its code): a request's whole round trip (download, local training,
upload) is one shifted-exponential random variable ``X = beta + Exp(mean)`` per *step unit*, where client ``i``'s
``beta`` and ``mean`` are scaled by a speed factor fixed for the run (25% slow x1.3, 50% normal x1.0, 25% fast
x0.7). With ``local_steps = K``:

- ``steps="scale"`` (default; the paper and its code): one draw per request,
  multiplied by ``K``: ``T_i = K * s_i * (beta + Exp(mean))``;
- ``steps="sum"``: ``K`` independent draws summed: ``T_i = s_i * (K beta + Gamma(K, mean))`` (same mean, less
  spread for large ``K``).

The paper's shape is ``mean = 2 beta``, e.g. the code's ``shift = 0.5 c_m``, ``mean = c_m`` with ``c_m`` the
measured per-step time of task m (:meth:`ShiftedExponential.fedast`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lightning_fedhet._checks import (
    as_float_array,
    as_numpy_mask,
    check_choice,
    check_int,
    check_range,
    check_real,
    check_round,
    check_seed,
)
from lightning_fedhet.seeding import STATIC_KEY, StaticKey, Stream, generator
from lightning_fedhet.system.steps import StepDistribution, local_steps_for


class ShiftedExponential:
    """FedAST's shifted-exponential latency with per-client speed groups (FedAST paper App. C.6).

    Client ``i`` in speed group ``g`` has shift ``shift * speed_factors[g]`` and exponential mean
    ``mean * speed_factors[g]`` per step unit (see the module docstring for how local steps scale it). Groups are
    assigned once at :meth:`setup` by a seeded random permutation; group ``g`` gets
    ``round(N * cumsum(group_fractions))`` boundaries, so sizes are as close to the fractions as possible.
    Round ``t``'s exponential (or gamma) draws come from ``generator(seed, Stream.LATENCY, t)`` for all ``N``
    clients, so latencies are pure functions of ``(seed, t)``.

    Args:
        shift: ``beta >= 0`` of a speed-1 client, per step unit.
        mean: mean ``> 0`` of the exponential part of a speed-1 client, per step unit (paper: ``2 beta``).
        speed_factors: multiplicative factor per group, each ``> 0`` (FedAST: ``(1.3, 1.0, 0.7)``).
        group_fractions: fraction of clients per group, ``>= 0``, summing to 1 within ``1e-9`` (FedAST:
            ``(0.25, 0.5, 0.25)``).
        steps: ``"scale"`` or ``"sum"`` (how ``local_steps`` enters).
    """

    #: FedAST's measured per-step time ``c_m`` of each task (paper §C.6; ``shift = 0.5 c_m``, ``mean = c_m``).
    FEDAST_STEP_TIMES = {"mnist": 0.148, "fmnist": 0.240, "cifar10": 0.228, "shakespeare": 0.555, "cifar100": 2.071}

    def __init__(self, shift: float = 0.5, mean: float = 1.0, speed_factors: Any = (1.3, 1.0, 0.7),
                 group_fractions: Any = (0.25, 0.5, 0.25), steps: str = "scale") -> None:
        self.shift = check_real(shift, "shift", 0.0, np.inf, high_open=True)
        self.mean = check_real(mean, "mean", 0.0, np.inf, low_open=True, high_open=True)
        factors = np.atleast_1d(as_float_array(speed_factors, "speed_factors"))
        fractions = np.atleast_1d(as_float_array(group_fractions, "group_fractions"))
        check_range(factors, "speed_factors", 0.0, np.inf, low_open=True, high_open=True)
        check_range(fractions, "group_fractions", 0.0, 1.0)
        if factors.shape != fractions.shape:
            raise ValueError(f"speed_factors and group_fractions must have the same length, got {factors.shape[0]} "
                             f"and {fractions.shape[0]}")
        if abs(float(fractions.sum()) - 1.0) > 1e-9:
            raise ValueError(f"group_fractions must sum to 1 (within 1e-9), got {float(fractions.sum()):.12g}")
        check_choice(steps, "steps", ("scale", "sum"))
        self.speed_factors = factors
        self.group_fractions = fractions
        self.steps = steps
        self.num_clients = 0
        self.seed = 0
        self.group = np.empty(0, dtype=np.int64)
        self.speed = np.empty(0)

    @classmethod
    def fedast(cls, task: str = "mnist", **kwargs: Any) -> ShiftedExponential:
        """FedAST's setting for ``task`` (one of :attr:`FEDAST_STEP_TIMES`): ``shift = 0.5 c``, ``mean = c``."""
        check_choice(task, "task", sorted(cls.FEDAST_STEP_TIMES))
        c = cls.FEDAST_STEP_TIMES[task]
        return cls(shift=0.5 * c, mean=c, **kwargs)

    def setup(self, num_clients: int, seed: int = 0) -> None:
        # checked and computed before anything is assigned: a refused setup leaves the object as it was
        num_clients, seed = check_int(num_clients, "num_clients"), check_seed(seed)
        bounds = np.rint(np.cumsum(self.group_fractions) * num_clients).astype(np.int64)
        bounds[-1] = num_clients
        sorted_groups = np.searchsorted(bounds, np.arange(num_clients), side="right")
        perm = generator(seed, Stream.LATENCY, STATIC_KEY, StaticKey.LATENCY_GROUPS).permutation(num_clients)
        group = np.empty(num_clients, dtype=np.int64)
        group[perm] = sorted_groups
        self.num_clients, self.seed, self.group, self.speed = num_clients, seed, group, self.speed_factors[group]

    def _check_setup(self) -> None:
        if self.num_clients < 1:
            raise RuntimeError("ShiftedExponential.setup(num_clients, seed) must be called first")

    def sample(self, round: int, clients_mask: Any, local_steps: Any = 1) -> np.ndarray:
        """Round-trip time (float64 ``[N]``) of each client in ``clients_mask`` in round ``round``; 0 elsewhere.

        Args:
            round: 0-based round index.
            clients_mask: bool ``[N]`` (numpy or torch) of the clients that got a request.
            local_steps: an int or per-client ints ``>= 1`` (only the masked clients' entries are used and checked).
        """
        self._check_setup()
        check_round(round)
        mask = as_numpy_mask(clients_mask, self.num_clients, "clients_mask")
        steps = np.asarray(local_steps.detach().cpu().numpy() if hasattr(local_steps, "detach") else local_steps)
        if steps.ndim == 0:
            steps = np.broadcast_to(steps, (self.num_clients,))
        elif steps.shape != (self.num_clients,):
            raise ValueError(f"local_steps must be an int or have shape ({self.num_clients},), got "
                             f"{tuple(steps.shape)}")
        steps = local_steps_for(np.where(mask, steps, 1), round, self.num_clients, self.seed).astype(np.float64)
        rng = generator(self.seed, Stream.LATENCY, int(round))
        if self.steps == "scale":
            per_step = self.shift + rng.exponential(self.mean, self.num_clients)
            times = steps * self.speed * per_step
        else:
            times = self.speed * (steps * self.shift + rng.gamma(steps, self.mean))
        return np.where(mask, times, 0.0)

    def on_time_probs(self, deadline: float, local_steps: Any = 1) -> np.ndarray:
        """Probability that each client answers within ``deadline`` seconds (float64 ``[N]``), in closed form.

        ``"scale"``: ``T = K s (shift + E)``, ``E ~ Exp(mean)``, so ``P(T <= D) = 1 - exp(-(D/(K s) - shift)/mean)``
        when ``D/(K s) > shift`` and 0 otherwise. ``"sum"``: ``T = s (K shift + G)``, ``G ~ Gamma(K, mean)``, so
        ``P(T <= D)`` is the regularised lower incomplete gamma ``P(K, (D/s - K shift)/mean)``.
        """
        self._check_setup()
        deadline = check_real(deadline, "deadline", 0.0, low_open=True)
        if isinstance(local_steps, StepDistribution):
            # P(T <= D) averaged over a random K needs K's distribution, which a StepDistribution does not expose;
            # reading its round-0 draw would hand back one sample as if it were the probability
            raise ValueError(
                f"local_steps must be an int or one int per client, got {local_steps!r}: the on-time probability "
                "is conditional on K; pass the round's draw (local_steps_for(distribution, round, N, seed))"
            )
        steps = local_steps_for(local_steps, 0, self.num_clients, self.seed).astype(np.float64)
        if self.steps == "scale":
            slack = deadline / (steps * self.speed) - self.shift
            return np.where(slack > 0, -np.expm1(-np.maximum(slack, 0.0) / self.mean), 0.0)
        slack = deadline / self.speed - steps * self.shift
        x = torch.as_tensor(np.maximum(slack, 0.0) / self.mean, dtype=torch.float64)
        prob = torch.special.gammainc(torch.as_tensor(steps, dtype=torch.float64), x).numpy()
        return np.where(slack > 0, prob, 0.0)

    def expected(self, local_steps: Any = 1) -> np.ndarray:
        """Mean round-trip time of every client (float64 ``[N]``): ``K s_i (shift + mean)``.

        ``local_steps`` may be a :class:`StepDistribution`: the time is linear in ``K`` under both step models, so
        the mean time is taken at the distribution's mean ``E[K_i]``."""
        self._check_setup()
        if isinstance(local_steps, StepDistribution):
            steps = np.asarray(local_steps.expected(self.num_clients), dtype=np.float64)
        else:
            steps = local_steps_for(local_steps, 0, self.num_clients, self.seed).astype(np.float64)
        return steps * self.speed * (self.shift + self.mean)

    def __repr__(self) -> str:
        return (f"ShiftedExponential(shift={self.shift:g}, mean={self.mean:g}, "
                f"speed_factors={tuple(self.speed_factors.tolist())}, "
                f"group_fractions={tuple(self.group_fractions.tolist())}, steps={self.steps!r})")


def _check_deadline(deadline: Any) -> float:
    return check_real(deadline, "deadline", 0.0, np.inf, low_open=True, high_open=True)


class VirtualClock:
    """Simulated wall-clock time of a synchronous run.

    A round lasts until the slowest client the server waits for has answered, or until the ``deadline`` if one
    is set and that comes first (late clients are then dropped: :meth:`on_time`). A round with no client lasts 0.
    The clock accumulates durations in :attr:`time` and goes into checkpoints via :meth:`state_dict`.

    Args:
        deadline: default per-round deadline in seconds (``> 0``), or None for no deadline.

    Usage::

        clock = VirtualClock(deadline=30.0)
        times = latency.sample(t, trained, steps)
        arrived = clock.on_time(times, trained)       # drop clients slower than the deadline
        clock.advance(times, trained)                  # -> this round's duration; clock.time is cumulative
    """

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = None if deadline is None else _check_deadline(deadline)
        self.time = 0.0
        self.rounds = 0

    def _deadline(self, deadline: float | None) -> float | None:
        return self.deadline if deadline is None else _check_deadline(deadline)

    @staticmethod
    def _times(times: Any, mask: Any) -> tuple[np.ndarray, np.ndarray]:
        arr = np.asarray(times.detach().cpu().numpy() if hasattr(times, "detach") else times, dtype=np.float64)
        if arr.ndim != 1:
            raise ValueError(f"times must be a 1-D per-client array, got shape {tuple(arr.shape)}")
        sel = np.ones(arr.shape[0], dtype=bool) if mask is None else as_numpy_mask(mask, arr.shape[0], "mask")
        picked = arr[sel]
        if not np.all(np.isfinite(picked)) or np.any(picked < 0):
            raise ValueError("times must be finite and >= 0 for the clients in mask")
        return arr, sel

    def round_duration(self, times: Any, mask: Any = None, deadline: float | None = None) -> float:
        """``min(max_i times[i], deadline)`` over the clients in ``mask`` (all if None); 0.0 if there are none."""
        arr, sel = self._times(times, mask)
        if not np.any(sel):
            return 0.0
        slowest = float(arr[sel].max())
        limit = self._deadline(deadline)
        return slowest if limit is None else min(slowest, limit)

    def on_time(self, times: Any, mask: Any = None, deadline: float | None = None) -> np.ndarray:
        """Bool ``[N]``: clients in ``mask`` whose time is within the deadline (all of them without one)."""
        arr, sel = self._times(times, mask)
        limit = self._deadline(deadline)
        return sel.copy() if limit is None else sel & (arr <= limit)

    def advance(self, times: Any, mask: Any = None, deadline: float | None = None) -> float:
        """Add this round's :meth:`round_duration` to :attr:`time` and return it."""
        duration = self.round_duration(times, mask, deadline)
        self.time += duration
        self.rounds += 1
        return duration

    def state_dict(self) -> dict:
        return {"time": self.time, "rounds": self.rounds, "deadline": self.deadline}

    def load_state_dict(self, state: dict) -> None:
        self.time = float(state["time"])
        self.rounds = int(state["rounds"])
        self.deadline = state.get("deadline", self.deadline)

    def __repr__(self) -> str:
        return f"VirtualClock(deadline={self.deadline}, time={self.time:g}, rounds={self.rounds})"
