"""The streaming weighted sum every aggregation rule builds in a round.

Most server rules are ``w_{t+1} = w_t + s * sum_{i in R_t} c_i * v_i`` for some per-client coefficient ``c_i``, a
vector ``v_i`` derived from client ``i``'s update (usually ``delta_i`` itself) and a scale ``s`` known only when the
round closes (``1 / sum c``, ``tau_eff``, ``server_lr``...). :class:`WeightedSum` is that sum, built one arrival at
a time, so a round holds exactly **one** extra ``d``-vector whatever the number of arrivals::

    acc = WeightedSum(like=params)              # total = 0 (dtype and device of ``params``)
    for i, delta in arrivals:
        acc.add(i, delta, weight=c_i)           # total += c_i * delta; weights[i] = c_i
    params = params + scale * acc.total

``weights`` records the weight of each client (insertion order = arrival order) for ``history`` and for scales that
depend on them (``sum c``). A rule whose vector coefficient differs from the weight it reports passes ``coef``:
``add(i, delta, weight=r_i, coef=r_i / a_i)`` adds ``(r_i / a_i) * delta`` and records ``r_i`` (FedNova).

**Combining partial sums.** The sum is associative: two accumulators over disjoint sets of clients (two processes,
two buffers of an asynchronous server) combine with :meth:`merge`, or, across processes, by all-reducing ``total``
(a plain tensor, summed elementwise) and taking the union of ``weights`` (:meth:`shares`); the result equals one
accumulator that saw every update, up to floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_fedhet.algorithms.base import RoundShares


class WeightedSum:
    """``total = sum_i coef_i * v_i`` over the clients added this round, with ``weights = {i: weight_i}``.

    Args:
        like: a tensor of the sum's shape ``[d]``, dtype and device (the global parameters); not modified.

    Attributes:
        total: the running sum, a tensor shaped, typed and placed like ``like`` (initially zeros).
        weights: ``{client: weight}`` of every client added, in arrival order.

    Example::

        >>> acc = WeightedSum(torch.zeros(2))
        >>> acc.add(0, torch.tensor([1.0, 2.0]), weight=0.5)
        >>> acc.add(3, torch.tensor([2.0, 0.0]), weight=0.25)
        >>> acc.total, acc.weights, acc.weight_sum
        (tensor([1., 1.]), {0: 0.5, 3: 0.25}, 0.75)
    """

    def __init__(self, like: Tensor) -> None:
        self.total: Tensor = torch.zeros_like(like)
        self.weights: dict[int, float] = {}

    def add(self, client: int, vector: Tensor, weight: float, coef: float | None = None) -> None:
        """``total += coef * vector`` (``coef`` defaults to ``weight``) and ``weights[client] = weight``.

        ``vector`` is cast to the dtype and device of ``total`` first. Raises ``ValueError`` if ``client`` was
        already added (each client contributes once per round).
        """
        client = int(client)
        if client in self.weights:
            raise ValueError(f"client {client} already added in this round")
        weight = float(weight)
        self.weights[client] = weight
        self.total.add_(vector.to(self.total), alpha=weight if coef is None else float(coef))

    def merge(self, other: WeightedSum) -> None:
        """Absorb a partial sum over a disjoint set of clients (``total += other.total``, union of ``weights``)."""
        if other.total.shape != self.total.shape:
            raise ValueError(
                f"cannot merge a sum of shape {tuple(other.total.shape)} into one of shape {tuple(self.total.shape)}"
            )
        both = self.weights.keys() & other.weights.keys()
        if both:
            raise ValueError(f"cannot merge partial sums that share clients {sorted(both)}")
        self.total.add_(other.total.to(self.total))
        self.weights.update(other.weights)

    def shares(self) -> RoundShares:
        """``total`` and ``weights`` as one process's shares of a round split over processes (combined in place)."""
        return RoundShares(sums=[self.total], tables=[self.weights])

    @property
    def weight_sum(self) -> float:
        """``sum_i weight_i`` (0.0 when empty), summed in arrival order."""
        return sum(self.weights.values())

    def scaled_weights(self, scale: float) -> dict[int, float]:
        """``{client: weight * scale}``, e.g. the weights actually applied once the round's scale is known."""
        return {c: w * scale for c, w in self.weights.items()}

    def __contains__(self, client: object) -> bool:
        return client in self.weights

    def __len__(self) -> int:
        return len(self.weights)

    def __iter__(self) -> Iterator[int]:
        return iter(self.weights)

    def __repr__(self) -> str:
        return f"WeightedSum(clients={list(self.weights)}, dim={self.total.numel()})"
