"""FedNova (Wang et al. 2020), the normalised-averaging baseline of the FedACS paper (spec
``shared/specs/fedacs.md`` §1.3 and §3.4, paper Eq. 116)::

    w_{t+1} = w_t + server_lr * tau_eff * sum_{i in R_t} q_i * delta_i / ||a_i||_1
    tau_eff = sum_{i in R_t} q_i ||a_i||_1

Client ``i``'s delta after ``tau_i`` local steps is ``delta_i = -eta * G_i a_i`` (Eq. 2), so ``delta_i/||a_i||_1``
is its *normalised* update (one step's worth of averaged gradient) and ``tau_eff`` rescales the average to a
common number of steps, removing the "structural" bias of heterogeneous local work (FedAvg weights client ``i``
by ``q_i ||a_i||_1``; FedNova by ``q_i``). ``q_i`` are the weights normalised over the arrived clients:
``alpha_i / sum_{R_t} alpha`` (``weighting="participating"``, default) or ``n_i / sum_{R_t} n``
(``"samples"``). ``tau_i`` is ``ClientInfo.local_steps`` (the steps the client actually ran).

``||a_i||_1`` for the local solvers (closed forms of spec §1.3, checked against FedNova's reference code):

=================================== ==================================================================
local solver                        ``||a||_1`` after ``tau`` steps
=================================== ==================================================================
SGD                                 ``tau``
SGD, momentum ``rho`` (PyTorch)     ``[tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)``
proximal SGD (``mu``, local lr eta)   ``[1 - (1 - eta mu)^tau] / (eta mu)``
momentum + proximal                 ``sum_k a_k`` from the exact linear recursion (see :func:`accumulation_norm`)
=================================== ==================================================================

With equal local work (``||a_i||_1`` the same for every arrived client) ``tau_eff / ||a_i||_1 = 1`` and FedNova is
``FedAvg`` with the same weighting: ``FedNova()`` == ``FedAvg(weighting="participating")`` and
``FedNova(weighting="samples")`` == ``FedAvg(weighting="samples")``. A round in which nobody arrives leaves ``w``
unchanged. Learning-rate schedules inside a round (``a_t = eta_t/eta``) are not modelled.
"""

from __future__ import annotations

import numbers

from torch import Tensor

from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares

NOVA_WEIGHTINGS = ("participating", "samples")


def accumulation_norm(steps: int, momentum: float = 0.0, prox: float = 0.0) -> float:
    """``||a||_1`` of ``steps`` local steps of SGD with ``momentum`` and proximal factor ``prox = local_lr * mu``.

    Momentum is PyTorch's (``v <- rho v + g + mu (x - x0)``, ``x <- x - eta v``). Writing
    ``x_k - x_0 = -eta sum_j c_{k,j} g_j`` and ``v_k = sum_j b_{k,j} g_j``, the coefficient sums obey
    ``B_k = rho B_{k-1} + 1 - prox C_k``, ``C_{k+1} = C_k + B_k``, and ``||a||_1 = C_tau`` (all ``a_j >= 0`` in
    the pure momentum and pure proximal cases; for the mixed case this is ``sum_j a_j``, as in FedNova's code).
    """
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"local_steps must be >= 1 for FedNova's normalisation, got {steps}")
    rho, c = float(momentum), float(prox)
    if rho == 0.0 and c == 0.0:
        return float(steps)
    if c == 0.0:
        return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)
    if rho == 0.0:
        return (1.0 - (1.0 - c) ** steps) / c
    b = total = 0.0
    for _ in range(steps):
        b = rho * b + 1.0 - c * total
        total += b
    return total


def check_local_solver(momentum: float, prox_mu: float, local_lr: float | None) -> None:
    """Validate the local-solver description that :func:`accumulation_norm` needs (FedNova, FedACS)."""
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if isinstance(prox_mu, bool) or not isinstance(prox_mu, numbers.Real) or not prox_mu >= 0.0:
        raise ValueError(f"prox_mu must be >= 0, got {prox_mu!r}")
    if local_lr is not None and not local_lr > 0:
        raise ValueError(f"local_lr must be > 0, got {local_lr!r}")
    if prox_mu > 0:
        if local_lr is None:
            raise ValueError("prox_mu > 0 needs local_lr (the client learning rate) to compute ||a_i||_1")
        if not local_lr * prox_mu <= 1.0:
            raise ValueError(f"local_lr * prox_mu must be in (0, 1], got {local_lr * prox_mu}")


class FedNova(Algorithm):
    """Normalised averaging: each delta divided by its client's ``||a_i||_1``, the average rescaled by ``tau_eff``.

    Args:
        momentum: local SGD momentum ``rho`` in ``[0, 1)`` (PyTorch convention, no dampening).
        prox_mu: FedProx proximal coefficient ``mu >= 0`` of the local solver.
        local_lr: client learning rate ``eta``; required when ``prox_mu > 0`` (with ``0 < eta * mu <= 1``).
        weighting: ``"participating"`` (``alpha_i``, default) or ``"samples"`` (``n_i``), normalised over arrivals.
        server_lr: ``eta_s > 0``.

    Example::

        >>> import torch
        >>> algo = FedNova()
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([1.0]), ClientInfo(1, local_steps=1))
        >>> algo.add(1, torch.tensor([3.0]), ClientInfo(1, local_steps=3))
        >>> algo.close_round()    # tau_eff = 2; 2 * (0.5 * 1/1 + 0.5 * 3/3)
        tensor([2.])
    """

    shares_rounds = True

    def __init__(
        self,
        momentum: float = 0.0,
        prox_mu: float = 0.0,
        local_lr: float | None = None,
        weighting: str = "participating",
        server_lr: float = 1.0,
    ) -> None:
        super().__init__()
        check_local_solver(momentum, prox_mu, local_lr)
        if weighting not in NOVA_WEIGHTINGS:
            raise ValueError(f"weighting must be one of {NOVA_WEIGHTINGS}, got {weighting!r}")
        if not server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        self.momentum = float(momentum)
        self.prox_mu = float(prox_mu)
        self.local_lr = None if local_lr is None else float(local_lr)
        self.weighting = weighting
        self.server_lr = float(server_lr)
        self._prox = self.prox_mu * self.local_lr if self.prox_mu > 0 else 0.0
        self._norms: dict[int, float] = {}
        self._sum: WeightedSum | None = None
        self._client_norms: dict[int, float] = {}
        self.last_tau_eff: float | None = None

    def hparams(self) -> dict:
        return {
            "momentum": self.momentum,
            "prox_mu": self.prox_mu,
            "local_lr": self.local_lr,
            "weighting": self.weighting,
            "server_lr": self.server_lr,
        }

    def norm(self, local_steps: int) -> float:
        """``||a||_1`` of this solver after ``local_steps`` steps (cached)."""
        steps = int(local_steps)
        if steps not in self._norms:
            self._norms[steps] = accumulation_norm(steps, self.momentum, self._prox)
        return self._norms[steps]

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        self._sum = WeightedSum(self.params)
        self._client_norms = {}

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._sum)
        a = self.norm(info.local_steps)
        raw = float(info.num_samples) if self.weighting == "samples" else float(self.client_weights[client])
        self._client_norms[client] = a
        self._sum.add(client, delta, raw, coef=raw / a)  # records q_i (unnormalised), adds q_i delta_i / ||a_i||_1

    def round_shares(self) -> RoundShares:
        shares = self._sum.shares()
        shares.tables.append(self._client_norms)
        return shares

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        total = self._sum.weight_sum
        if total > 0:
            tau_eff = sum(r * self._client_norms[c] for c, r in self._sum.weights.items()) / total
            scale = tau_eff / total
            self.last_weights = {c: r * scale / self._client_norms[c] for c, r in self._sum.weights.items()}
            self.params = self.params + (self.server_lr * scale) * self._sum.total
        else:
            self.last_weights = {}
        self.last_tau_eff = tau_eff if total > 0 else None
        self._sum = None
        return self.params
