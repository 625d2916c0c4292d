"""CA-Fed (Rodio et al., thesis ch. 2 / INFOCOM 2023) and the baselines of its experiments, AdaFed (:mod:`.adafed`)
and F3AST (:mod:`.f3ast`) (thesis §2.5.1, "Benchmarks").

Clients' availability follows independent two-state Markov chains with stationary activity ``pi_i`` and (signed)
second eigenvalue ``lambda_i = P(0->0) + P(1->1) - 1`` (thesis §2.2). FedAvg-like training with weights ``q``
converges to ``F_B = sum_i p_i F_i`` with ``p = pi ⊙~ q`` (``(pi ⊙~ q)_i = pi_i q_i / sum_h pi_h q_h``, eq. 2.4);
``q = alpha/pi`` ("Unbiased", ``FedAvg(weighting="known_p")``) removes the bias but is slow when rarely available or
strongly correlated clients carry large weights. All rules here take the server step (2.3) without projection::

    w_{t+1} = w_t + server_lr * sum_{i received} q_i * delta_i          (q NOT renormalised, except AdaFed)

=========== ================================================================================= ===================
rule        who trains / ``q_i``                                                               thesis
=========== ================================================================================= ===================
``CAFed``   available clients with ``q_i > 0``; ``q = alpha/pi_hat`` then greedy exclusion     §2.4, Alg. 3
``AdaFed``  all available; ``q_i = (alpha_i/pi_i) / sum_{j in S_t} alpha_j/pi_j``               §2.5.1, App. G
``F3AST``   top ``k`` available by ``alpha_i^2 / r_i^2``; ``q_i = alpha_i / r_i``                 §2.5.1, App. G
=========== ================================================================================= ===================

``alpha`` are the ``client_weights`` of :meth:`setup`. Each rule observes every client's availability once per
round: in :meth:`select` (``available``) or, if the strategy selects by other means, in :meth:`open_round`
(``RoundContext.available``); the estimates used in round ``t`` include round ``t``'s observation (Alg. 3 line 4).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_bool, check_choice, check_length, check_real, check_round, check_vector
from lightning_fedhet.algorithms._availability import AvailabilityRule
from lightning_fedhet.algorithms.adafed import PI_SOURCES, AdaFed
from lightning_fedhet.algorithms.availability_estimators import MarkovAvailabilityEstimator
from lightning_fedhet.algorithms.base import ClientInfo, RoundContext, RoundShares
from lightning_fedhet.algorithms.f3ast import F3AST, F3AST_RATES

# AdaFed, F3AST and the estimator lived in this module; their import path keeps working.
__all__ = [
    "CAFed",
    "AdaFed",
    "F3AST",
    "MarkovAvailabilityEstimator",
    "compute_weights",
    "proxy_error",
    "LOSS_SOURCES",
    "PI_SOURCES",
    "F3AST_RATES",
]

_F64 = torch.float64
LOSS_SOURCES = ("train", "probe")


def _clone(x):
    return None if x is None else x.clone()


# ---------------------------------------------------------------------------------------------- ComputeWeights
def _float64_array(x) -> np.ndarray:
    """``x`` as a float64 numpy array; tensors through ``Tensor.numpy()`` (``np.asarray(tensor, dtype=...)`` goes
    through ``Tensor.__array__``, which numpy 2 warns about on every call for lacking a ``copy`` keyword)."""
    if isinstance(x, Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def proxy_error(q, alpha, gap, gamma: float, pi, kappa_bar_sq: float, bias_factor: float = 4.0) -> float:
    """CA-Fed's estimated total error, eq. 2.25::

        eps = <gap, p> + bias_factor * kappa_bar_sq * d_TV(alpha, p)^2 * Gamma,     p = pi ⊙~ q

    ``gap = F_hat - F_hat*`` per client, ``Gamma`` the dissimilarity estimate, ``d_TV = 1/2 ||alpha - p||_1``.
    Returns ``inf`` when ``sum pi q = 0`` (everybody excluded).
    """
    q, alpha, gap, pi = (_float64_array(x) for x in (q, alpha, gap, pi))
    w = pi * q
    total = w.sum()
    if not total > 0:
        return math.inf
    p = w / total
    tv = 0.5 * np.abs(alpha - p).sum()
    return float(gap @ p + bias_factor * kappa_bar_sq * tv * tv * gamma)


def compute_weights(
    q,
    alpha,
    gap,
    gamma: float,
    pi,
    key,
    kappa_bar_sq: float,
    tau: float = 0.0,
    bias_factor: float = 4.0,
    strict: bool = True,
) -> Tensor:
    """Procedure ComputeWeights of Algorithm 3 (lines 13-22): greedy exclusion in descending order of ``key``.

    For each client in that order (ties: lower id first) tentatively set ``q_i = 0``; keep the removal when
    :func:`proxy_error` falls by at least ``tau`` (revert otherwise, spec P3). With ``strict=True`` a removal must
    also *strictly* lower the error (by more than ``1e-12`` relative), so at ``tau = 0`` ties, e.g. the
    ``eps == 0`` of early training, drop nobody (spec P2; the thesis' literal ``>=`` would drop all but one).
    Removing the last client is never accepted (``eps = inf``). Clients already at ``q_i = 0`` are skipped.

    Returns:
        the new weights, float64 ``[N]`` (same values as ``q`` for kept clients, 0 for excluded ones).
    """
    check_real(tau, "tau", 0.0)
    q = _float64_array(q).copy()
    alpha, gap, pi, key = (_float64_array(x) for x in (alpha, gap, pi, key))
    eps = proxy_error(q, alpha, gap, gamma, pi, kappa_bar_sq, bias_factor)
    for i in np.argsort(-key, kind="stable"):
        if q[i] == 0.0:
            continue
        trial = q.copy()
        trial[i] = 0.0
        eps_trial = proxy_error(trial, alpha, gap, gamma, pi, kappa_bar_sq, bias_factor)
        drop = eps - eps_trial
        if drop >= tau and (not strict or drop > 1e-12 * max(1.0, abs(eps))):
            q, eps = trial, eps_trial
    return torch.from_numpy(q)


# ---------------------------------------------------------------------------------------------- CA-Fed
class CAFed(AvailabilityRule):
    """CA-Fed (thesis Algorithm 3): drop correlated / rarely available clients when it lowers the error bound.

    Every round ``t``:

    1. observe every client's availability and update ``pi_hat``, ``lam_hat`` (:class:`MarkovAvailabilityEstimator`;
       or the oracle ``pi``/``lam`` given here, the thesis' default experiments);
    2. ``q = alpha / pi_hat`` for **all** ``N`` clients, rebuilt every round with no memory of past exclusions;
    3. ``q = ComputeWeights(q, key=|lam_hat|)`` (most correlated first; ``|lambda_2|`` orders clients like the
       analysis' ``lambda(P_i) = (|lambda_2| + 1)/2``), then ``ComputeWeights(q, key=-pi_hat)`` (least available
       first), see :func:`compute_weights`;
    4. the available clients with ``q_i > 0`` train (:meth:`select`; excluded ones stay idle) and the server takes
       ``w + server_lr * sum_{received} q_i delta_i`` with ``q`` **not** renormalised (eq. 2.3). A round in which no
       update with ``q_i > 0`` arrives leaves ``w`` unchanged (as the authors' code skips it).

    The error proxy (eq. 2.25) uses ``gap_i = F_hat_i - F_hat_i*`` and ``Gamma_hat = max_i gap_i`` (eq. 2.24):
    ``F_hat`` is the loss filter of eq. 2.22 (weight ``beta`` on the newest loss) and ``F_hat*`` its running minimum,
    or the oracle ``f_star`` (local optima, as in the authors' code) when given.

    Decisions where the thesis is ambiguous:

    - ``beta``: weight on the **newest** loss, ``(0, 1]``; the thesis' "beta = 0" (no smoothing) is ``beta=1``
      (the default).
    - ties: ``strict=True`` (default) accepts a removal only if it lowers the error strictly *and* by ``>= tau``,
      so while ``gap == 0`` (no loss seen yet, or losses only decreasing) CA-Fed equals Unbiased. ``strict=False``
      is the thesis' literal ``>=``. The last client is never removed.
    - ComputeWeights reverts a rejected removal (each candidate is tested against the currently accepted ``q``).
    - loss probe: ``loss_source="train"`` (default) feeds ``ClientInfo.loss`` (mean training loss of the client's
      local steps) of the clients that arrived into eq. 2.22 at the end of the round, so round ``t`` uses losses up
      to ``t-1``; clients that never reported a loss get the mean gap of those that did (``Gamma_hat`` is the max
      over reporting clients; 0 before any). ``loss_source="probe"`` is thesis Alg. 3 line 3: the rule ignores
      training losses and answers ``True`` to :meth:`wants_probe_losses`, so the server evaluates the global model
      ``w_t`` on one batch of every available client and calls :meth:`observe_losses` ``(t, losses)`` **before**
      :meth:`select` of round ``t``; round ``t``'s weights then use the losses at ``w_t``. Without that call the
      round fails with ``RuntimeError`` (it never silently falls back to Unbiased).
    - The bias term is ``bias_factor * kappa_bar_sq * d_TV^2 * Gamma`` with the thesis' ``bias_factor = 4``; the
      authors' code omits the 4 (its ``bias_const = 1`` is ``kappa_bar_sq = 0.25`` here).
    - estimates: transitions are counted per visit of the source state (unbiased; the authors' code divides by the
      elapsed time), priors are ``pi_prior`` and ``transition_prior`` pseudo-counts.
    - availability is ``RoundContext.available`` / the ``available`` mask (all ``N`` clients, every round).

    Args:
        kappa_bar_sq: bias weight ``kappa_bar^2 >= 0`` (thesis default 1; ``inf``-like values give Unbiased).
        tau: minimum decrease of the error proxy to accept a removal, ``>= 0`` (thesis 0).
        beta: loss-filter weight on the newest loss, ``(0, 1]``.
        pi: oracle stationary availabilities (``N`` values in ``(0, 1]``) instead of the estimates.
        lam: oracle correlations (``N`` values in ``[-1, 1]``) instead of the estimates.
        f_star: oracle local optimum losses ``F_i*`` (``N`` finite values) instead of the running minimum.
        pi_prior, transition_prior: priors of :class:`MarkovAvailabilityEstimator`.
        bias_factor: constant of the bias term (4 in the thesis).
        strict: see "ties" above.
        loss_source: ``"train"`` or ``"probe"`` (see "loss probe" above).
        server_lr: ``eta_s > 0``.

    ``.pi_hat`` / ``.lam_hat``: the availabilities/correlations used by the rule (estimates, or the oracle values);
    ``.last_q``: this round's ``q`` (float64 ``[N]``, 0 = excluded); ``.last_error``: its proxy error.

    Cost: ``O(N)`` scalars of state (no per-client model copies); ``O(N^2)`` per round for the two exclusion passes
    (``2N`` evaluations of an ``O(N)`` proxy), negligible for ``N`` in the hundreds.
    """

    def __init__(
        self,
        kappa_bar_sq: float = 1.0,
        tau: float = 0.0,
        beta: float = 1.0,
        pi=None,
        lam=None,
        f_star=None,
        pi_prior=(1.0, 1.0),
        transition_prior: float = 1.0,
        bias_factor: float = 4.0,
        strict: bool = True,
        loss_source: str = "train",
        server_lr: float = 1.0,
    ) -> None:
        super().__init__(server_lr)
        self.kappa_bar_sq = check_real(kappa_bar_sq, "kappa_bar_sq", 0.0)
        self.tau = check_real(tau, "tau", 0.0)
        self.beta = check_real(beta, "beta", 0.0, 1.0, low_open=True)
        self.bias_factor = check_real(bias_factor, "bias_factor", 0.0)
        self.strict = check_bool(strict, "strict")
        self.loss_source = check_choice(loss_source, "loss_source", LOSS_SOURCES)
        self._pi_oracle = None if pi is None else check_vector(pi, "pi", 0.0, 1.0, low_open=True)
        self._lam_oracle = None if lam is None else check_vector(lam, "lam", -1.0, 1.0)
        self._f_star = None if f_star is None else check_vector(f_star, "f_star", -math.inf, math.inf)
        self.estimator = MarkovAvailabilityEstimator(pi_prior, transition_prior)
        self.loss_hat: Tensor | None = None  # F_hat, nan = never reported
        self.loss_min: Tensor | None = None  # running min of F_hat
        self.last_q: Tensor | None = None
        self.last_error: float | None = None
        self.last_gamma: float | None = None
        self._pending: dict[int, float] = {}
        self._losses_round: int | None = None  # round of the last observe_losses

    def hparams(self) -> dict:
        out = {
            "kappa_bar_sq": self.kappa_bar_sq,
            "tau": self.tau,
            "beta": self.beta,
            "bias_factor": self.bias_factor,
            "strict": self.strict,
            "loss_source": self.loss_source,
            "server_lr": self.server_lr,
        }
        for name, v in (("pi", self._pi_oracle), ("lam", self._lam_oracle), ("f_star", self._f_star)):
            if v is not None:
                out[name] = v.tolist()
        return out

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        for name, v in (("pi", self._pi_oracle), ("lam", self._lam_oracle), ("f_star", self._f_star)):
            if v is not None:
                check_length(v.numel(), self.num_clients, name)
        self.estimator.setup(self.num_clients)
        self.loss_hat = torch.full((self.num_clients,), float("nan"), dtype=_F64)
        self.loss_min = self.loss_hat.clone()
        self._losses_round = None

    @property
    def pi_hat(self) -> Tensor:
        """Stationary availabilities used by the rule (float64 ``[N]``): oracle ``pi`` or the Bayesian estimate."""
        return self._pi_oracle.clone() if self._pi_oracle is not None else self.estimator.pi_hat()

    @property
    def lam_hat(self) -> Tensor:
        """Correlations ``lambda_i`` used by the rule (float64 ``[N]``): oracle ``lam`` or the Bayesian estimate."""
        return self._lam_oracle.clone() if self._lam_oracle is not None else self.estimator.lam_hat()

    def wants_probe_losses(self) -> bool:
        """``True`` with ``loss_source="probe"``: the server must call :meth:`observe_losses` before :meth:`select`."""
        return self.loss_source == "probe"

    def observe_losses(self, round: int, losses: Tensor) -> None:
        """Feed one round of losses into the filter of eq. 2.22 and the running minimum.

        Args:
            round: the round the losses belong to; with ``loss_source="probe"`` the probe at ``w_t`` of round
                ``t``, given before :meth:`select` of that round (once per round, rounds increasing).
            losses: float ``[N]``, ``nan`` (or any non-finite value) where a client was not probed.
        """
        self._check_ready()
        round = check_round(round)
        if self._losses_round is not None and round <= self._losses_round:
            raise ValueError(f"observe_losses(round={round}) after round {self._losses_round}: losses are fed "
                             "once per round, in increasing round order")
        x = torch.as_tensor(losses, dtype=_F64).detach().flatten().cpu()
        check_length(x.numel(), self.num_clients, "losses")
        seen = torch.isfinite(x)
        first = seen & torch.isnan(self.loss_hat)
        again = seen & ~first
        self.loss_hat[first] = x[first]
        self.loss_hat[again] = (1.0 - self.beta) * self.loss_hat[again] + self.beta * x[again]
        self.loss_min[seen] = torch.fmin(self.loss_min[seen], self.loss_hat[seen])
        self._losses_round = round

    def loss_gaps(self) -> tuple[Tensor, float]:
        """``(gap, Gamma_hat)``: ``gap_i = F_hat_i - F_hat_i*`` (>= 0; mean known gap for unknown clients)."""
        floor = self._f_star if self._f_star is not None else self.loss_min
        gap = (self.loss_hat - floor).clamp(min=0.0)
        known = torch.isfinite(gap)
        if not known.any():
            return torch.zeros(self.num_clients, dtype=_F64), 0.0
        gap = torch.where(known, gap, gap[known].mean())
        return gap, float(gap[known].max())

    def _on_round(self, round: int, available: Tensor) -> None:
        if self.loss_source == "probe" and self._losses_round != round:
            raise RuntimeError(
                f"CAFed(loss_source='probe') needs observe_losses({round}, losses) before select({round}): the "
                "one-batch losses of the available clients at the current global model (thesis Alg. 3 line 3); "
                f"the last probe was for round {self._losses_round}. Use loss_source='train' when nothing probes."
            )
        self.estimator.update(available)
        pi, lam, alpha = self.pi_hat, self.lam_hat, self.client_weights
        gap, gamma = self.loss_gaps()
        q = alpha / pi
        args = dict(kappa_bar_sq=self.kappa_bar_sq, tau=self.tau, bias_factor=self.bias_factor, strict=self.strict)
        q = compute_weights(q, alpha, gap, gamma, pi, lam.abs(), **args)
        q = compute_weights(q, alpha, gap, gamma, pi, -pi, **args)
        self.last_q = q
        self.last_gamma = gamma
        self.last_error = proxy_error(q, alpha, gap, gamma, pi, self.kappa_bar_sq, self.bias_factor)

    def _choose(self, available: Tensor) -> Tensor:
        return available & (self.last_q > 0)

    def _round_weights(self, ctx: RoundContext | None) -> Tensor:
        self._pending = {}
        return self.last_q

    def _on_add(self, client: int, info: ClientInfo) -> None:
        if self.loss_source == "train" and math.isfinite(float(info.loss)):
            self._pending[client] = float(info.loss)

    def round_shares(self) -> RoundShares:
        shares = super().round_shares()
        shares.tables.append(self._pending)  # the training losses reported this round (loss_source="train")
        return shares

    def _on_close(self) -> None:
        if self._pending:
            losses = torch.full((self.num_clients,), float("nan"), dtype=_F64)
            losses[list(self._pending)] = torch.tensor(list(self._pending.values()), dtype=_F64)
            self.observe_losses(self._observed_round, losses)
        self._pending = {}

    def _rule_state(self) -> dict:
        return {
            "estimator": self.estimator.state_dict(),
            "loss_hat": _clone(self.loss_hat),
            "loss_min": _clone(self.loss_min),
            "last_q": _clone(self.last_q),
            "last_error": self.last_error,
            "last_gamma": self.last_gamma,
            "losses_round": self._losses_round,
        }

    def _load_rule_state(self, state: dict) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.loss_hat, self.loss_min = _clone(state["loss_hat"]), _clone(state["loss_min"])
        self.last_q = _clone(state["last_q"])
        self.last_error, self.last_gamma = state["last_error"], state["last_gamma"]
        self._losses_round = state["losses_round"]
