"""AdaFed as run in CA-Fed's experiments (Tan et al. 2022; thesis ch. 2 §2.5 "Benchmarks"): every available client
trains and the weights ``alpha_i / pi_i`` are normalised over the round's set (see :mod:`~.cafed`)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice, check_mask
from lightning_fedhet.algorithms._availability import AvailabilityRule
from lightning_fedhet.algorithms.availability_estimators import MarkovAvailabilityEstimator
from lightning_fedhet.algorithms.base import RoundContext

_F64 = torch.float64
PI_SOURCES = ("known", "estimate")


class AdaFed(AvailabilityRule):
    """AdaFed as run in the thesis (Tan et al. 2022; thesis ch. 2 §2.5.1, "Benchmarks"): every available client
    trains and the weights ``alpha_i / pi_i`` are normalised over this round's set ``S_t`` every round::

        q_i = (alpha_i / pi_i) / sum_{j in S_t} alpha_j / pi_j,      w <- w + server_lr * sum_{i received} q_i delta_i

    ``S_t`` is ``RoundContext.selected`` (the clients asked to train: all available ones under AdaFed's own
    :meth:`select`); a client whose update is lost keeps its share of the normaliser (its term is just missing).

    Args:
        pi_source: ``"known"`` (default; ``RoundContext.availability_probs``, the true availability ``pi`` as in
            the thesis' experiments, not the probability of being aggregated, which also holds the links) or
            ``"estimate"`` (:class:`MarkovAvailabilityEstimator`'s ``pi_hat``).
        pi_prior: prior of the estimator.
        server_lr: ``> 0``.
    """

    def __init__(self, pi_source: str = "known", pi_prior=(1.0, 1.0), server_lr: float = 1.0) -> None:
        super().__init__(server_lr)
        self.pi_source = check_choice(pi_source, "pi_source", PI_SOURCES)
        self.estimator = MarkovAvailabilityEstimator(pi_prior)
        self.last_pi: Tensor | None = None

    def hparams(self) -> dict:
        return {"pi_source": self.pi_source, "server_lr": self.server_lr}

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        self.estimator.setup(self.num_clients)

    def selection_probs(self, round: int) -> Tensor:
        """AdaFed trains every available client: ``P(selected | available) = 1``."""
        return torch.ones(self.num_clients, dtype=_F64)

    def _on_round(self, round: int, available: Tensor) -> None:
        self.estimator.update(available)

    def _round_weights(self, ctx: RoundContext | None) -> Tensor:
        if self.pi_source == "known":
            probs = None if ctx is None else ctx.availability_probs
            pi = self._context_probs(probs, "availability_probs", "AdaFed(pi_source='known')")
        else:
            pi = self.estimator.pi_hat()
        self.last_pi = pi
        members = ctx.selected if ctx is not None and ctx.selected is not None else self.last_available
        members = check_mask(members, self.num_clients, "selected")
        raw = torch.where(members, self.client_weights / pi, torch.zeros_like(pi))
        total = float(raw.sum())
        return raw / total if total > 0 else raw

    def _rule_state(self) -> dict:
        return {"estimator": self.estimator.state_dict()}

    def _load_rule_state(self, state: dict) -> None:
        self.estimator.load_state_dict(state["estimator"])
