"""FedAST's allocation arithmetic (Algorithms 3-4, eq. 3), framework-free: the normalised inter-client variance of
a task's recent updates, what ``R_m`` is made proportional to, and an integer split of the request budget.

Askin, Sharma, Joe-Wong, Joshi, "FedAST: Federated Asynchronous Simultaneous Training", UAI 2024.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice

#: the rules for R_m: the paper's eq. 3 with Algorithm 4's scaling, or the authors' code (linear in the variance)
ALLOCATIONS = ("paper", "code")


def resolve_per_task(value: int | Mapping[str, int], tasks: Sequence[str], name: str) -> dict[str, int]:
    """``value`` (one int for every task, or a mapping task -> int naming exactly ``tasks``) as a dict."""
    if isinstance(value, Mapping):
        if set(value) != set(tasks):
            raise ValueError(f"{name} names tasks {sorted(value)}, but the tasks are {list(tasks)}")
        return {t: int(value[t]) for t in tasks}
    return {t: int(value) for t in tasks}


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
    check_choice(rule, "rule", ALLOCATIONS)
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
