"""The two ways of training several models on one client pool: FedAST and the synchronous Sync-ST.

Askin, Sharma, Joe-Wong, Joshi, "FedAST: Federated Asynchronous Simultaneous Training", UAI 2024.

- :class:`FedAST` (Algorithm 2): each task ``m`` keeps ``R_m`` requests in flight, buffers ``b_m`` arriving
  updates, then takes one server step ``x_m <- x_m + eta_s * mean(w_local - w_sent)`` (eq. 9: stale updates are
  applied as they are). Option ``"S"`` keeps ``R_m, b_m`` fixed; option ``"D"`` re-splits the request budget
  every ``0.75 * M * sum_m R_m`` updates (Algorithms 3-4).
- :class:`SyncST` (Sync-ST, Bhuyan et al. 2023, the paper's baseline): rounds; the round's clients are split
  at random across the tasks, every task runs synchronous FedAvg, optionally keeping only its first ``k``
  arrivals (the paper's straggler mitigation, ``k = 30``).

Both are configuration objects; :meth:`FedAST.build` / :meth:`SyncST.build` create the event-driven server
(:mod:`lightning_fedhet.asynchronous.server`). The pieces of the dynamic allocation are plain functions here,
:func:`normalized_variance` (Algorithm 4) and :func:`split_budget` / :func:`allocation_scores` (eq. 3).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

OPTIONS = ("S", "D")
ALLOCATIONS = ("paper", "code")


def _positive_int(value: Any, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _per_task(value: Any, name: str) -> int | dict[str, int]:
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(f"{name} must not be an empty mapping")
        return {str(k): _positive_int(v, f"{name}[{k!r}]") for k, v in value.items()}
    return _positive_int(value, name)


def resolve_per_task(value: int | Mapping[str, int], tasks: Sequence[str], name: str) -> dict[str, int]:
    """``value`` (one int for every task, or a mapping task -> int naming exactly ``tasks``) as a dict."""
    if isinstance(value, Mapping):
        if set(value) != set(tasks):
            raise ValueError(f"{name} names tasks {sorted(value)}, but the tasks are {list(tasks)}")
        return {t: int(value[t]) for t in tasks}
    return {t: int(value) for t in tasks}


class FedAST:
    """FedAST's server rule (paper Algorithm 2) as a configuration.

    Args:
        option: ``"S"`` static (``K_m = 1`` new request per arrival, ``R_m`` and ``b_m`` fixed) or ``"D"``
            dynamic (Algorithm 3 re-splits the budget; ``K_m = clip(R_m - in_flight_m, 0, max_new)``).
        requests: ``R_m^(0)``, requests kept in flight per task: one int for every task or a mapping task -> int.
        buffer: ``b_m^(0)``, updates per server step: an int or a mapping task -> int (``b = 1``: no buffer,
            the paper's "FedAST-NoBuffer"). The ratio ``R_m / b_m`` stays fixed under reallocation
            (Algorithm 3 line 4; the paper keeps it below ~37).
        server_lr: ``eta_s > 0`` (paper: 0.1 with a buffer, 0.038 without).
        window: ``V``, the last updates per task used by the variance estimate (paper: 8).
        period: reallocation every ``period * M * sum_m R_m`` received updates, ``M`` = tasks still training
            (paper App. A: 0.75).
        allocation: ``"paper"``: ``R_m ∝ sigma_hat_m`` with ``sigma_hat_m^2 = eta_c eta_s tau sigma_tilde_m^2``
            (eq. 3 and Algorithm 4); ``"code"``: the authors' code, ``R_m ∝ eta_s sigma_tilde_m^2 /
            (eta_c tau^2)`` (its ``(...)**1/2`` parses as a halving, not a square root, so the rule is linear in
            the variance).
        quantum: every ``R_m`` is a multiple of ``quantum`` (1: any integer; the authors' code uses 32).
        max_new: the most new requests one arrival may send in option ``"D"`` (paper: 2).

    Example::

        rule = FedAST(option="D", requests=96, buffer=3, server_lr=0.1)
        server = rule.build({"mnist": Task(x0, local_steps=27, latency=ShiftedExponential.fedast("mnist"))},
                            num_clients=1000, participation=Bernoulli(0.3), seed=0)
    """

    def __init__(
        self,
        option: str = "S",
        requests: int | Mapping[str, int] = 96,
        buffer: int | Mapping[str, int] = 3,
        server_lr: float = 0.1,
        window: int = 8,
        period: float = 0.75,
        allocation: str = "paper",
        quantum: int = 1,
        max_new: int = 2,
    ) -> None:
        if option not in OPTIONS:
            raise ValueError(f"option must be one of {OPTIONS}, got {option!r}")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        if not (math.isfinite(float(server_lr)) and float(server_lr) > 0):
            raise ValueError(f"server_lr must be a finite number > 0, got {server_lr!r}")
        if not (math.isfinite(float(period)) and float(period) > 0):
            raise ValueError(f"period must be a finite number > 0, got {period!r}")
        self.option = option
        self.requests = _per_task(requests, "requests")
        self.buffer = _per_task(buffer, "buffer")
        self.server_lr = float(server_lr)
        self.window = _positive_int(window, "window", low=2)
        self.period = float(period)
        self.allocation = allocation
        self.quantum = _positive_int(quantum, "quantum")
        self.max_new = _positive_int(max_new, "max_new")

    def build(self, tasks: Mapping[str, Any], num_clients: int, participation: Any = None, slot: float = 1.0,
              seed: int = 0):
        """The event-driven server for ``tasks`` (:class:`~.server.FedASTServer`); the first requests are sent."""
        from lightning_fedhet.asynchronous.server import FedASTServer

        return FedASTServer(self, tasks, num_clients, participation=participation, slot=slot, seed=seed)

    def __repr__(self) -> str:
        return (f"FedAST(option={self.option!r}, requests={self.requests}, buffer={self.buffer}, "
                f"server_lr={self.server_lr:g}, window={self.window}, period={self.period:g}, "
                f"allocation={self.allocation!r}, quantum={self.quantum}, max_new={self.max_new})")


class SyncST:
    """Synchronous simultaneous training (Sync-ST), the paper's baseline (§5.2, App. C).

    Round ``r``: the available clients (``participation.sample(r)``), or ``clients_per_round`` of them drawn
    uniformly without replacement, are split at random across the tasks still training, task ``m`` getting
    ``n_m ≈ n * w_m / sum w`` of them (largest remainder). Every chosen client runs one request
    (its queue first: a client still busy with a discarded straggler starts later). Task ``m`` keeps its first
    ``first_k`` arrivals (all with ``first_k=None``) and takes the FedAvg step
    ``x_m <- x_m + server_lr * mean(kept deltas)``. The round ends when the last kept update of any task is in.

    Args:
        first_k: arrivals kept per task (the paper: 30), or None to wait for every client.
        clients_per_round: clients drawn among the available ones each round, or None for all of them.
        server_lr: ``eta_s > 0`` (paper: 1).
        weights: relative share of the round's clients per task (mapping task -> weight > 0); default equal.
    """

    def __init__(self, first_k: int | None = None, clients_per_round: int | None = None, server_lr: float = 1.0,
                 weights: Mapping[str, float] | None = None) -> None:
        self.first_k = None if first_k is None else _positive_int(first_k, "first_k")
        self.clients_per_round = None if clients_per_round is None else _positive_int(
            clients_per_round, "clients_per_round")
        if not (math.isfinite(float(server_lr)) and float(server_lr) > 0):
            raise ValueError(f"server_lr must be a finite number > 0, got {server_lr!r}")
        self.server_lr = float(server_lr)
        if weights is not None:
            weights = {str(k): float(v) for k, v in weights.items()}
            if not weights or any(not (math.isfinite(v) and v > 0) for v in weights.values()):
                raise ValueError(f"weights must map every task to a finite number > 0, got {weights!r}")
        self.weights = weights

    def build(self, tasks: Mapping[str, Any], num_clients: int, participation: Any = None, slot: float = 1.0,
              seed: int = 0):
        """The round-based server for ``tasks`` (:class:`~.server.SyncSTServer`). ``slot`` is unused (rounds)."""
        from lightning_fedhet.asynchronous.server import SyncSTServer

        return SyncSTServer(self, tasks, num_clients, participation=participation, seed=seed)

    def __repr__(self) -> str:
        return (f"SyncST(first_k={self.first_k}, clients_per_round={self.clients_per_round}, "
                f"server_lr={self.server_lr:g}, weights={self.weights})")


def normalized_variance(updates: Tensor) -> float:
    """Algorithm 4 lines 1-2: ``(1/V) sum_i ||Delta_i - mean||^2 / ||mean||^2`` of updates ``[V, d]``.

    The ratio does not change when every update is scaled by the same factor, so raw deltas
    ``w_local - w_sent`` give the same value as the paper's ``(x_sent - x_local) / (tau eta_c)``.
    Returns ``inf`` when the mean update is zero.
    """
    if updates.dim() != 2 or updates.shape[0] < 2:
        raise ValueError(f"updates must have shape [V, d] with V >= 2, got {tuple(updates.shape)}")
    u = updates.to(torch.float64)
    mean = u.mean(dim=0)
    denom = float(mean.square().sum())
    spread = float((u - mean).square().sum(dim=1).mean())
    return spread / denom if denom > 0 else math.inf


def allocation_scores(variances: Mapping[str, float], rule: str, server_lr: float,
                      client_lr: Mapping[str, float], local_steps: Mapping[str, int]) -> dict[str, float]:
    """What ``R_m`` is made proportional to, from the normalised variances ``sigma_tilde_m^2``.

    ``"paper"``: ``sigma_hat_m = sqrt(eta_c eta_s tau sigma_tilde^2)`` (Algorithm 4 line 3, eq. 3);
    ``"code"``: ``eta_s sigma_tilde^2 / (eta_c tau^2)`` (the authors' code, linear in the variance).
    """
    if rule not in ALLOCATIONS:
        raise ValueError(f"rule must be one of {ALLOCATIONS}, got {rule!r}")
    out = {}
    for m, var in variances.items():
        if rule == "paper":
            out[m] = math.sqrt(client_lr[m] * server_lr * local_steps[m] * var)
        else:
            out[m] = server_lr * var / (client_lr[m] * local_steps[m] ** 2)
    return out


def split_budget(total: int, scores: Mapping[str, float], quantum: int = 1, minimum: int = 1) -> dict[str, int]:
    """Integers ``R_m`` summing to ``total`` with ``R_m ∝ scores[m]`` (eq. 3), in multiples of ``quantum``.

    The ``total // quantum`` units are shared by largest remainder (ties: the task listed first), then
    a task below ``minimum`` units takes one from the task holding the most, until none is below.
    ``total`` must be a multiple of ``quantum`` and ``scores`` finite, ``>= 0`` and not all zero.

    Example: ``split_budget(384, {"a": 1.0, "b": 2.0}) == {"a": 128, "b": 256}``.
    """
    total, quantum = int(total), int(quantum)
    if quantum < 1 or total % quantum:
        raise ValueError(f"total={total} must be a multiple of quantum={quantum} >= 1")
    names = list(scores)
    values = [float(scores[m]) for m in names]
    if not names or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"scores must be finite, >= 0 and not all zero, got {dict(scores)}")
    units = total // quantum
    if units < minimum * len(names):
        raise ValueError(f"total={total} cannot give each of {len(names)} tasks {minimum} x {quantum}")
    ideal = [units * v / sum(values) for v in values]
    share = [math.floor(x) for x in ideal]
    order = sorted(range(len(names)), key=lambda i: (-(ideal[i] - share[i]), i))
    for i in order[: units - sum(share)]:
        share[i] += 1
    while min(share) < minimum:
        low, high = share.index(min(share)), share.index(max(share))
        share[low] += 1
        share[high] -= 1
    return {m: s * quantum for m, s in zip(names, share)}
