"""FedAvg (McMahan et al. 2017) with the weightings used in the papers, all in delta space.

The server update is ``w_{t+1} = w_t + server_lr * sum_{i in R_t} q_i * delta_i`` where ``R_t`` is the
set of clients whose update arrived and ``delta_i = w_i^{(t,K)} - w_t``. The weights ``q_i``:

============== ============================================== ==========================================
weighting      q_i                                            source
============== ============================================== ==========================================
participating  ``alpha_i / sum_{j in R_t} alpha_j``           "average participating" (FedAU paper)
all            ``alpha_i`` (``1/N`` for uniform alpha)        "average all" (FedAU paper): absent clients
                                                              count as a zero update
samples        ``n_i / sum_{j in R_t} n_j``                   McMahan et al. 2017, per-sample fairness
known_p        ``alpha_i / p_i``                              unbiased FedAvg: FedStale paper Eq. 5
                                                              (thesis Eq. 3.5), the FedAU paper's "known
                                                              statistics"; ``p_i`` = probability that
                                                              the update is aggregated
============== ============================================== ==========================================

``alpha`` are the client weights given to :meth:`setup` (uniform ``1/N`` by default), ``n_i`` the
client's sample count from :class:`ClientInfo`. A round in which nobody arrives leaves ``w`` unchanged.

``"all"`` is not the thesis's Algorithm 1 (line 8, ``w_{t+1} = sum_{i in S_t} |D_i|/|D| w_i``): that averages
*models* without renormalising, so under partial participation it shrinks ``w`` towards 0, while ``"all"`` adds
``sum_{R_t} alpha_i delta_i`` to ``w_t`` (an absent client contributes "stay at ``w_t``"). The two agree only under
full participation. ``"known_p"`` is unbiased because ``E[1{i in R_t}] / p_i = 1``: ``E[sum_{R_t} alpha_i
delta_i / p_i] = sum_i alpha_i delta_i``, the full-participation step, whose fixed point is the objective
``sum_i alpha_i F_i``. Plain averaging over ``R_t`` is biased towards clients that arrive often (it minimises the
``p``-weighted objective, FedStale paper Eq. 4, thesis Eq. 2.4).
"""

from __future__ import annotations

import math

from torch import Tensor

from lightning_fedhet._checks import check_real
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares
from lightning_fedhet.algorithms.weighting import NORMALISED, check_weighting, raw_weight, weightings

WEIGHTINGS = weightings("participating", "all", "samples", "known_p")


class FedAvg(Algorithm):
    """Federated averaging of client deltas.

    Args:
        weighting: one of ``"participating"``, ``"all"``, ``"samples"``, ``"known_p"`` (see module doc).
        server_lr: server step size ``eta_s > 0`` multiplying the averaged delta (1.0 = plain FedAvg).

    Example::

        >>> import torch
        >>> algo = FedAvg(weighting="participating")
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([1.0]), ClientInfo(num_samples=1, local_steps=1))
        >>> algo.add(1, torch.tensor([3.0]), ClientInfo(num_samples=1, local_steps=1))
        >>> algo.close_round()
        tensor([2.])
    """

    shares_rounds = True

    def __init__(self, weighting: str = "participating", server_lr: float = 1.0) -> None:
        super().__init__()
        check_weighting(weighting, WEIGHTINGS)
        server_lr = check_real(server_lr, "server_lr", 0.0, math.inf, low_open=True, high_open=True)
        self.weighting = weighting
        self.server_lr = float(server_lr)
        self._sum: WeightedSum | None = None
        self._probs: Tensor | None = None

    def hparams(self) -> dict:
        return {"weighting": self.weighting, "server_lr": self.server_lr}

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        self._probs = None
        if self.weighting == "known_p":
            probs = None if ctx is None else ctx.participation_probs
            self._probs = self._context_probs(probs, "participation_probs", "weighting='known_p'")
        self._sum = WeightedSum(self.params)

    def _raw_weight(self, client: int, info: ClientInfo) -> float:
        prob = float(self._probs[client]) if self.weighting == "known_p" else None
        return raw_weight(self.weighting, float(self.client_weights[client]), info.num_samples, prob)

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._sum)
        self._sum.add(client, delta, self._raw_weight(client, info))

    def round_shares(self) -> RoundShares:
        return self._sum.shares()

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        scale = 1.0
        if self.weighting in NORMALISED:
            total = self._sum.weight_sum
            scale = 1.0 / total if total > 0 else 0.0
        self.last_weights = self._sum.scaled_weights(scale)
        if len(self._sum) > 0:
            self.params = self.params + (self.server_lr * scale) * self._sum.total
        self._sum = None
        return self.params
