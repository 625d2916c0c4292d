"""Estimates of each client's Markov availability from its observed on/off sequence (thesis §2.4.2), used by CA-Fed
(:mod:`~lightning_fedhet.algorithms.cafed`) and AdaFed (:mod:`~lightning_fedhet.algorithms.adafed`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fedhet._checks import check_length, check_mask, check_real, check_vector

_F64 = torch.float64


def _clone(x):
    return None if x is None else x.clone()


class MarkovAvailabilityEstimator:
    """Bayesian (beta-prior) estimates of each client's stationary activity ``pi_i`` and correlation ``lambda_i``.

    Thesis §2.4.2::

        pi_hat_i  = (#active rounds_i + n_i) / (t + n_i + m_i)
        P_hat_i(1->1) = (N11_i + a) / (N11_i + N10_i + 2a),   P_hat_i(0->0) = (N00_i + a) / (N00_i + N01_i + 2a)
        lam_hat_i = P_hat_i(0->0) + P_hat_i(1->1) - 1

    with ``t`` the number of observed rounds and ``N_ab`` the observed transitions ``a -> b``. The transition
    probabilities use proper conditional counts (per visits of the source state), not the authors' code's division
    by the total time (spec P12). Priors: ``pi_prior = (n, m)`` pseudo-counts of active/inactive rounds (default
    ``(1, 1)``: ``pi_hat`` starts at 1/2) and ``transition_prior = a`` pseudo-count per transition (default 1:
    ``lam_hat`` starts at 0). Both must be ``> 0`` (so ``0 < pi_hat < 1`` always). Vectorised over clients.

    Example::

        >>> est = MarkovAvailabilityEstimator()
        >>> est.setup(1)
        >>> for s in [1, 1, 0, 1]:
        ...     est.update(torch.tensor([bool(s)]))
        >>> est.pi_hat()          # (3 + 1) / (4 + 2)
        tensor([0.6667], dtype=torch.float64)
        >>> est.lam_hat()         # P11 = (1+1)/(2+2), P00 = (0+1)/(1+2): 0.5 + 1/3 - 1
        tensor([-0.1667], dtype=torch.float64)
    """

    def __init__(self, pi_prior=(1.0, 1.0), transition_prior: float = 1.0) -> None:
        try:
            n, m = pi_prior
        except (TypeError, ValueError) as err:
            raise ValueError(f"pi_prior must be a pair (n, m) of positive pseudo-counts, got {pi_prior!r}") from err
        self.prior_n = check_vector(n, "pi_prior", 0.0, math.inf, low_open=True)
        self.prior_m = check_vector(m, "pi_prior", 0.0, math.inf, low_open=True)
        self.transition_prior = check_real(transition_prior, "transition_prior", 0.0, low_open=True)
        self.num_clients = 0
        self.rounds = 0
        self.active: Tensor | None = None  # int64 [N] number of active rounds
        self.trans: Tensor | None = None  # int64 [N, 2, 2], trans[i, a, b] = #(a -> b)
        self.prev: Tensor | None = None  # bool [N] state of the last observed round

    def setup(self, num_clients: int) -> None:
        n = self.num_clients = int(num_clients)
        for name, prior in (("n", self.prior_n), ("m", self.prior_m)):
            if prior.numel() != 1:
                check_length(prior.numel(), n, f"pi_prior {name}")
        self.rounds = 0
        self.active = torch.zeros(n, dtype=torch.int64)
        self.trans = torch.zeros((n, 2, 2), dtype=torch.int64)
        self.prev = None

    def update(self, active: Tensor) -> None:
        """Observe one round's availability (bool ``[N]``)."""
        if self.active is None:
            raise RuntimeError("MarkovAvailabilityEstimator.setup(num_clients) must be called first")
        a = check_mask(active, self.num_clients, "active")
        if self.prev is not None:
            idx = torch.arange(self.num_clients)
            self.trans[idx, self.prev.long(), a.long()] += 1
        self.active += a.long()
        self.rounds += 1
        self.prev = a.clone()

    def pi_hat(self) -> Tensor:
        """``pi_hat_i`` (float64 ``[N]``)."""
        return (self.active.to(_F64) + self.prior_n) / (self.rounds + self.prior_n + self.prior_m)

    def transition_probs(self) -> tuple[Tensor, Tensor]:
        """``(P_hat(0->0), P_hat(1->1))``, float64 ``[N]`` each."""
        c = self.trans.to(_F64)
        a = self.transition_prior
        p00 = (c[:, 0, 0] + a) / (c[:, 0, 0] + c[:, 0, 1] + 2 * a)
        p11 = (c[:, 1, 1] + a) / (c[:, 1, 1] + c[:, 1, 0] + 2 * a)
        return p00, p11

    def lam_hat(self) -> Tensor:
        """``lambda_hat_i = P_hat(0->0) + P_hat(1->1) - 1`` (float64 ``[N]``, in ``(-1, 1)``)."""
        p00, p11 = self.transition_probs()
        return p00 + p11 - 1.0

    def state_dict(self) -> dict:
        return {
            "num_clients": self.num_clients,
            "rounds": self.rounds,
            "active": _clone(self.active),
            "trans": _clone(self.trans),
            "prev": _clone(self.prev),
        }

    def load_state_dict(self, state: dict) -> None:
        self.num_clients = int(state["num_clients"])
        self.rounds = int(state["rounds"])
        self.active, self.trans, self.prev = _clone(state["active"]), _clone(state["trans"]), _clone(state["prev"])
