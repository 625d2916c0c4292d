"""Aggregation over lossy links (thesis ch. 4, Rodio et al. WPMC 2023).

Client ``i``'s round trip (downlink of ``w_t`` and uplink of its result) succeeds with probability ``1 - q_i``,
independently across clients and rounds (Assumption 14); ``S_t`` is the set whose update arrived. With
``alpha`` the client weights of :meth:`setup` (the thesis' experiments use ``alpha_i = |D_i|/|D|``) and
``w_i = w_t + delta_i`` the local model:

========= ======================================================================= ===========================
rule      new global model                                                         thesis
========= ======================================================================= ===========================
UPGAPL    ``w_t + server_lr * sum_{i in S_t} alpha_i/(1-q_i) * delta_i``          Eq. 4.5, Algorithm 5
DMAPL     ``sum_{i in S_t} alpha_i w_i / sum_{i in S_t} alpha_i``                 Eq. 4.2 (M. Chen et al.)
UDMAPL    ``sum_{i in S_t} alpha_i/(1-q_i) * w_i``  (not renormalised)            Eq. 4.4
========= ======================================================================= ===========================

What a lost packet means in each rule:

- UPGA-PL (pseudo-gradients): a lost client contributes a zero *update*, i.e. it counts as "stay at ``w_t``";
  the ``1/(1-q_i)`` factor makes the expected update equal to the lossless ``sum_i alpha_i delta_i``.
- DMA-PL (model averaging): lost clients are simply left out and the received models are averaged with their
  weights renormalised over ``S_t`` (equal to ``FedAvg(weighting="participating")``). Biased towards reliable
  clients: in expectation it weights client ``i`` by about ``alpha_i (1-q_i)``.
- UDMA-PL: a lost client contributes a zero *model* (not ``w_t``), and the received models are scaled by
  ``1/(1-q_i)`` without renormalisation. Unbiased in expectation, but its variance scales with the model norm,
  ``sum alpha_i^2 q_i/(1-q_i) ||w_i||^2`` (Lemma A.1). With ``S_t`` empty Eq. 4.4 literally returns the **zero
  model**, which wipes out training: ``empty_round="keep"`` (default) keeps ``w_t`` instead, and ``"zero"`` is the
  literal rule (it warns once when it happens).

UPGA-PL and DMA-PL keep ``w_t`` when nobody arrives.

``q_i`` (UPGAPL, UDMAPL) comes from, per the ``q`` argument:

- ``"known"`` (default): ``1 - q_i = RoundContext.participation_probs[i]``, the probability that client ``i``'s
  update is aggregated this round (the thesis gives the true ``q``, §1.2). Under the thesis's setting (every client
  selected, independent losses, no deadline) that is exactly the link's success probability ``(1 - q_down)(1 -
  q_up)``; under partial participation it also holds ``P(selected)``, and with a deadline ``P(on time | K_i(t))``,
  without which ``E[1{i in S_t} / (1 - q_i)]`` is not 1 and the update is biased towards reliable, fast clients;
- ``"estimate"``: an online estimate from rounds ``< t`` only (so the weight is independent of this round's
  outcome): ``1 - q_hat_i = (arrivals_i + 1) / (attempts_i + 1)``, where an attempt is a round in which the
  client was in ``RoundContext.selected`` and an arrival a round in which :meth:`add` was called for it. The
  ``+1`` prior starts every client at ``q_hat = 0`` (lossless until proven otherwise) and keeps ``1 - q_hat > 0``;
  the mean is over the whole history (stationary losses, Assumption 14);
- a sequence of ``N`` fixed values ``q_i`` in ``[0, 1)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice, check_real, check_vector
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares

Q_SOURCES = ("known", "estimate")


class SuccessEstimator:
    """Online estimate of each client's round-trip success probability ``1 - q_i``.

    ``estimates() = (arrivals + 1) / (attempts + 1)`` with counts over the rounds seen by :meth:`update`.
    """

    def __init__(self) -> None:
        self.attempts: Tensor | None = None
        self.arrivals: Tensor | None = None

    def setup(self, num_clients: int) -> None:
        self.attempts = torch.zeros(int(num_clients), dtype=torch.int64)
        self.arrivals = torch.zeros(int(num_clients), dtype=torch.int64)

    def update(self, attempted: Tensor, arrived: Tensor) -> None:
        attempted = torch.as_tensor(attempted).flatten().cpu() != 0
        arrived = torch.as_tensor(arrived).flatten().cpu() != 0
        self.attempts += (attempted | arrived).to(torch.int64)
        self.arrivals += arrived.to(torch.int64)

    def estimates(self) -> Tensor:
        return (self.arrivals + 1).to(torch.float64) / (self.attempts + 1).to(torch.float64)

    def state_dict(self) -> dict:
        return {"attempts": self.attempts.clone(), "arrivals": self.arrivals.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.attempts = state["attempts"].clone()
        self.arrivals = state["arrivals"].clone()


class _LossyAggregator(Algorithm):
    """Shared plumbing: per-round weighted sum of deltas, ``q`` handling, fresh-client bookkeeping."""

    uses_q = True
    shares_rounds = True

    def __init__(self, q: str | Sequence[float] | Tensor) -> None:
        super().__init__()
        self._fixed_q: Tensor | None = None
        self.estimator: SuccessEstimator | None = None
        if isinstance(q, str):
            if q not in Q_SOURCES:
                raise ValueError(f"q must be one of {Q_SOURCES} or a sequence of N loss probabilities, got {q!r}")
            self.q = q
            if q == "estimate":
                self.estimator = SuccessEstimator()
        else:
            self._fixed_q = check_vector(q, "q (loss probabilities)", 0.0, 1.0, high_open=True).flatten()
            self.q = "fixed"
        self._sum: WeightedSum | None = None
        self._success: Tensor | None = None

    def hparams(self) -> dict:
        if not self.uses_q:
            return {}
        return {"q": self._fixed_q.tolist() if self._fixed_q is not None else self.q}

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        if self._fixed_q is not None and self._fixed_q.numel() != self.num_clients:
            raise ValueError(f"q has {self._fixed_q.numel()} entries but num_clients={self.num_clients}")
        if self.estimator is not None:
            self.estimator.setup(self.num_clients)

    def _success_probs(self, ctx: RoundContext | None) -> Tensor:
        if self._fixed_q is not None:
            return 1.0 - self._fixed_q
        if self.estimator is not None:
            return self.estimator.estimates()
        # 1 - q_i = P(client i's update is aggregated this round): selection x links x deadline
        probs = None if ctx is None else ctx.participation_probs
        return self._context_probs(probs, "participation_probs", f"{type(self).__name__}(q='known')")

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        if self.estimator is not None and (ctx is None or ctx.selected is None):
            raise ValueError("q='estimate' needs RoundContext.selected to count transmission attempts")
        self._success = self._success_probs(ctx) if self.uses_q else None
        self._sum = WeightedSum(self.params)

    def _raw_weight(self, client: int) -> float:
        alpha = float(self.client_weights[client])
        return alpha / float(self._success[client]) if self.uses_q else alpha

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._sum)
        self._sum.add(client, delta, self._raw_weight(client))

    def round_shares(self) -> RoundShares:
        return self._sum.shares()

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        self.params = self._combine()
        if self.estimator is not None:
            arrived = torch.zeros(self.num_clients, dtype=torch.bool)
            if len(self._sum) > 0:
                arrived[list(self._sum)] = True
            self.estimator.update(self.ctx.selected, arrived)
        self._sum = None
        return self.params

    def _combine(self) -> Tensor:
        raise NotImplementedError

    def loss_estimates(self) -> Tensor | None:
        """Current ``q_hat`` (``q="estimate"``), float64 ``[N]``, else ``None``."""
        return None if self.estimator is None else 1.0 - self.estimator.estimates()

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["success_estimator"] = None if self.estimator is None else self.estimator.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.estimator is not None:
            if state.get("success_estimator") is None:
                raise ValueError("state has no success estimator but q='estimate'")
            self.estimator.load_state_dict(state["success_estimator"])


class UPGAPL(_LossyAggregator):
    """Unbiased pseudo-gradient aggregation under packet loss (thesis Algorithm 5, Eq. 4.5).

    Args:
        q: ``"known"`` (``1 - RoundContext.participation_probs``), ``"estimate"`` or ``N`` fixed values in ``[0, 1)``.
        server_lr: ``eta_s > 0`` (1 in the thesis).

    Example::

        >>> algo = UPGAPL(q=[0.5, 0.0])
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([1.0]), ClientInfo(1, 1))
        >>> algo.close_round()        # (1/2) / (1 - 0.5) * 1
        tensor([1.])
    """

    def __init__(self, q: str | Sequence[float] | Tensor = "known", server_lr: float = 1.0) -> None:
        super().__init__(q)
        server_lr = check_real(server_lr, "server_lr", 0.0, math.inf, low_open=True, high_open=True)
        self.server_lr = float(server_lr)

    def hparams(self) -> dict:
        return {**super().hparams(), "server_lr": self.server_lr}

    def _combine(self) -> Tensor:
        self.last_weights = dict(self._sum.weights)
        if len(self._sum) == 0:
            return self.params
        return self.params + self.server_lr * self._sum.total


class DMAPL(_LossyAggregator):
    """Direct model averaging over the received models, renormalised (thesis Eq. 4.2; baseline).

    Needs no ``q``. Equal to ``FedAvg(weighting="participating")``; keeps ``w_t`` when nobody arrives.
    """

    uses_q = False

    def __init__(self) -> None:
        super().__init__("known")

    def _combine(self) -> Tensor:
        total = self._sum.weight_sum
        if total <= 0:
            self.last_weights = {}
            return self.params
        self.last_weights = {c: r / total for c, r in self._sum.weights.items()}
        return self.params + (1.0 / total) * self._sum.total


class UDMAPL(_LossyAggregator):
    """Unbiased direct model averaging: ``sum_{S_t} alpha_i/(1-q_i) w_i`` (thesis Eq. 4.4; baseline).

    Args:
        q: ``"known"``, ``"estimate"`` or ``N`` fixed values in ``[0, 1)``.
        empty_round: what a round in which nobody arrives returns: ``"keep"`` (default, ``w_t``) or ``"zero"``
            (literal Eq. 4.4: the zero model, with a one-time warning).
    """

    def __init__(self, q: str | Sequence[float] | Tensor = "known", empty_round: str = "keep") -> None:
        super().__init__(q)
        check_choice(empty_round, "empty_round", ("zero", "keep"))
        self.empty_round = empty_round
        self._warned = False

    def hparams(self) -> dict:
        return {**super().hparams(), "empty_round": self.empty_round}

    def _combine(self) -> Tensor:
        self.last_weights = dict(self._sum.weights)
        if len(self._sum) == 0:
            if self.empty_round == "keep":
                return self.params
            if not self._warned:
                warnings.warn(
                    "UDMAPL: no update arrived this round; Eq. 4.4 returns the zero model "
                    "(pass empty_round='keep' to keep w_t instead)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._warned = True
            return torch.zeros_like(self.params)
        # sum_i c_i (w_t + delta_i) = (sum_i c_i) w_t + sum_i c_i delta_i
        return self._sum.weight_sum * self.params + self._sum.total
