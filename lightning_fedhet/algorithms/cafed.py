"""CA-Fed (Rodio et al., thesis ch. 2 / INFOCOM 2023; spec ``shared/specs/thesis_ch1_ch2_cafed.md`` §2) and the
baselines of its experiments, AdaFed and F3AST (spec §3.4).

Clients' availability follows independent two-state Markov chains with stationary activity ``pi_i`` and (signed)
second eigenvalue ``lambda_i = P(0->0) + P(1->1) - 1`` (spec §2.2). FedAvg-like training with weights ``q``
converges to ``F_B = sum_i p_i F_i`` with ``p = pi ⊙~ q`` (``(pi ⊙~ q)_i = pi_i q_i / sum_h pi_h q_h``, eq. 2.4);
``q = alpha/pi`` ("Unbiased", ``FedAvg(weighting="known_p")``) removes the bias but is slow when rarely available or
strongly correlated clients carry large weights. All rules here take the server step (2.3) without projection::

    w_{t+1} = w_t + server_lr * sum_{i received} q_i * delta_i          (q NOT renormalised, except AdaFed)

=========== ================================================================================= ===================
rule        who trains / ``q_i``                                                               spec
=========== ================================================================================= ===================
``CAFed``   available clients with ``q_i > 0``; ``q = alpha/pi_hat`` then greedy exclusion     §2.4-2.6, Alg. 3
``AdaFed``  all available; ``q_i = (alpha_i/pi_i) / sum_{j in S_t} alpha_j/pi_j``               §3.4.3
``F3AST``   top ``k`` available by ``alpha_i^2 / r_i^2``; ``q_i = alpha_i / r_i``                 §3.4.4
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

from lightning_fedhet._checks import (
    check_choice,
    check_int,
    check_length,
    check_mask,
    check_real,
    check_round,
    check_vector,
)
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares

_F64 = torch.float64
PI_SOURCES = ("known", "estimate")
LOSS_SOURCES = ("train", "probe")
F3AST_RATES = ("ema", "code", "exact")


def _clone(x):
    return None if x is None else x.clone()


# ---------------------------------------------------------------------------------------------- estimators
class MarkovAvailabilityEstimator:
    """Bayesian (beta-prior) estimates of each client's stationary activity ``pi_i`` and correlation ``lambda_i``.

    Thesis §2.4.2 (spec §2.6)::

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


# ---------------------------------------------------------------------------------------------- ComputeWeights
def _float64_array(x) -> np.ndarray:
    """``x`` as a float64 numpy array; tensors through ``Tensor.numpy()`` (``np.asarray(tensor, dtype=...)`` goes
    through ``Tensor.__array__``, which numpy 2 warns about on every call for lacking a ``copy`` keyword)."""
    if isinstance(x, Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def proxy_error(q, alpha, gap, gamma: float, pi, kappa_bar_sq: float, bias_factor: float = 4.0) -> float:
    """CA-Fed's estimated total error, eq. 2.25 (spec §2.10)::

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


# ---------------------------------------------------------------------------------------------- shared plumbing
class _AvailabilityRule(Algorithm):
    """Observes availability once per round (in select or open_round); aggregates ``sum q_i delta_i``."""

    selects_clients = True
    shares_rounds = True

    def __init__(self, server_lr: float = 1.0) -> None:
        super().__init__()
        self.server_lr = check_real(server_lr, "server_lr", 0.0, low_open=True)
        self._observed_round: int | None = None
        self.last_available: Tensor | None = None
        self._weights: Tensor | None = None
        self._sum: Tensor | None = None
        self._raw: dict[int, float] = {}

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        self._observed_round = None
        self.last_available = None

    def _observe(self, round: int, available: Tensor) -> None:
        if self._observed_round == int(round):
            return
        mask = check_mask(available, self.num_clients, "available")
        self._on_round(int(round), mask)
        self._observed_round = int(round)
        self.last_available = mask

    def _on_round(self, round: int, available: Tensor) -> None:
        raise NotImplementedError

    def _choose(self, available: Tensor) -> Tensor:
        return available.clone()

    def _round_weights(self, ctx: RoundContext | None) -> Tensor:
        raise NotImplementedError

    def select(self, round: int, available: Tensor, rng: np.random.Generator) -> Tensor:
        self._check_ready()
        self._observe(round, available)
        return self._choose(check_mask(available, self.num_clients, "available"))

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        if ctx is not None and ctx.available is not None:
            self._observe(round, ctx.available)
        elif self._observed_round != int(round):
            raise ValueError(
                f"{type(self).__name__} must observe every client's availability: call select({round}, ...) or "
                "pass a RoundContext with `available`"
            )
        self._weights = self._round_weights(ctx)
        self._sum = torch.zeros_like(self.params)
        self._raw = {}

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._raw)
        raw = float(self._weights[client])
        self._raw[client] = raw
        if raw != 0.0:
            self._sum.add_(delta.to(self._sum), alpha=raw)
        self._on_add(client, info)

    def _on_add(self, client: int, info: ClientInfo) -> None:
        pass

    def round_shares(self) -> RoundShares:
        return RoundShares(sums=[self._sum], tables=[self._raw])

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        if any(r != 0.0 for r in self._raw.values()):
            self.params = self.params + self.server_lr * self._sum
        self.last_weights = dict(self._raw)
        self._on_close()
        self._sum = None
        return self.params

    def _on_close(self) -> None:
        pass

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["observed_round"] = self._observed_round
        state["last_available"] = _clone(self.last_available)
        state["rule"] = self._rule_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._observed_round = state["observed_round"]
        self.last_available = _clone(state["last_available"])
        self._load_rule_state(state["rule"])

    def _rule_state(self) -> dict:
        return {}

    def _load_rule_state(self, state: dict) -> None:
        pass


# ---------------------------------------------------------------------------------------------- CA-Fed
class CAFed(_AvailabilityRule):
    """CA-Fed (thesis Algorithm 3): drop correlated / rarely available clients when it lowers the error bound.

    Every round ``t``:

    1. observe every client's availability and update ``pi_hat``, ``lam_hat`` (:class:`MarkovAvailabilityEstimator`;
       or the oracle ``pi``/``lam`` given here, the thesis' default experiments, spec P12);
    2. ``q = alpha / pi_hat`` for **all** ``N`` clients, rebuilt every round with no memory of past exclusions (P4);
    3. ``q = ComputeWeights(q, key=|lam_hat|)`` (most correlated first; ``|lambda_2|`` orders clients like the
       analysis' ``lambda(P_i) = (|lambda_2| + 1)/2``), then ``ComputeWeights(q, key=-pi_hat)`` (least available
       first), see :func:`compute_weights`;
    4. the available clients with ``q_i > 0`` train (:meth:`select`; excluded ones stay idle) and the server takes
       ``w + server_lr * sum_{received} q_i delta_i`` with ``q`` **not** renormalised (P5). A round in which no
       update with ``q_i > 0`` arrives leaves ``w`` unchanged (P17).

    The error proxy (eq. 2.25) uses ``gap_i = F_hat_i - F_hat_i*`` and ``Gamma_hat = max_i gap_i`` (eq. 2.24):
    ``F_hat`` is the loss filter of eq. 2.22 (weight ``beta`` on the newest loss) and ``F_hat*`` its running minimum,
    or the oracle ``f_star`` (local optima, as in the authors' code) when given.

    Decisions on the spec's pitfalls (``shared/specs/thesis_ch1_ch2_cafed.md`` §6):

    - P1 ``beta``: weight on the **newest** loss, ``(0, 1]``; the thesis' "beta = 0" (no smoothing) is ``beta=1``
      (the default).
    - P2 ties: ``strict=True`` (default) accepts a removal only if it lowers the error strictly *and* by ``>= tau``,
      so while ``gap == 0`` (no loss seen yet, or losses only decreasing) CA-Fed equals Unbiased. ``strict=False``
      is the thesis' literal ``>=``. The last client is never removed.
    - P3: revert-on-reject (each candidate is tested against the currently accepted ``q``).
    - P8 loss probe: ``loss_source="train"`` (default) feeds ``ClientInfo.loss`` (mean training loss of the client's
      local steps) of the clients that arrived into eq. 2.22 at the end of the round, so round ``t`` uses losses up
      to ``t-1``; clients that never reported a loss get the mean gap of those that did (``Gamma_hat`` is the max
      over reporting clients; 0 before any). ``loss_source="probe"`` is thesis Alg. 3 line 3: the rule ignores
      training losses and answers ``True`` to :meth:`wants_probe_losses`, so the server evaluates the global model
      ``w_t`` on one batch of every available client and calls :meth:`observe_losses` ``(t, losses)`` **before**
      :meth:`select` of round ``t``; round ``t``'s weights then use the losses at ``w_t``. Without that call the
      round fails with ``RuntimeError`` (it never silently falls back to Unbiased).
    - The bias term is ``bias_factor * kappa_bar_sq * d_TV^2 * Gamma`` with the thesis' ``bias_factor = 4``; the
      authors' code omits the 4 (its ``bias_const = 1`` is ``kappa_bar_sq = 0.25`` here).
    - P12: transitions are counted per visit of the source state (unbiased), priors are ``pi_prior`` and
      ``transition_prior`` pseudo-counts.
    - H.B: availability is ``RoundContext.available`` / the ``available`` mask (all ``N`` clients, every round).

    Args:
        kappa_bar_sq: bias weight ``kappa_bar^2 >= 0`` (thesis default 1; ``inf``-like values give Unbiased).
        tau: minimum decrease of the error proxy to accept a removal, ``>= 0`` (thesis 0).
        beta: loss-filter weight on the newest loss, ``(0, 1]``.
        pi: oracle stationary availabilities (``N`` values in ``(0, 1]``) instead of the estimates.
        lam: oracle correlations (``N`` values in ``[-1, 1]``) instead of the estimates.
        f_star: oracle local optimum losses ``F_i*`` (``N`` finite values) instead of the running minimum.
        pi_prior, transition_prior: priors of :class:`MarkovAvailabilityEstimator`.
        bias_factor: constant of the bias term (4 in the thesis).
        strict: see P2 above.
        loss_source: ``"train"`` or ``"probe"`` (P8).
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
        self.strict = bool(strict)
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


# ---------------------------------------------------------------------------------------------- baselines
class AdaFed(_AvailabilityRule):
    """AdaFed as run in the thesis (Tan et al. 2022; spec §3.4.3): every available client trains and the weights
    ``alpha_i / pi_i`` are normalised over this round's set ``S_t`` every round::

        q_i = (alpha_i / pi_i) / sum_{j in S_t} alpha_j / pi_j,      w <- w + server_lr * sum_{i received} q_i delta_i

    ``S_t`` is ``RoundContext.selected`` (the clients asked to train: all available ones under AdaFed's own
    :meth:`select`); a client whose update is lost keeps its share of the normaliser (its term is just missing).

    Args:
        pi_source: ``"known"`` (default; ``RoundContext.participation_probs``, the true ``pi`` as in the thesis'
            experiments) or ``"estimate"`` (:class:`MarkovAvailabilityEstimator`'s ``pi_hat``).
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

    def _on_round(self, round: int, available: Tensor) -> None:
        self.estimator.update(available)

    def _round_weights(self, ctx: RoundContext | None) -> Tensor:
        if self.pi_source == "known":
            probs = None if ctx is None else ctx.participation_probs
            if probs is None:
                raise ValueError("AdaFed(pi_source='known') needs RoundContext.participation_probs (the true pi_i)")
            pi = check_vector(probs, "participation_probs", 0.0, 1.0, low_open=True, num_clients=self.num_clients)
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


class F3AST(_AvailabilityRule):
    """F3AST as run in the thesis' experiments (Ribero et al. 2023; thesis ch. 2 §2.5, "Benchmarks"): each round

    1. update every client's activity rate ``r_i`` (see ``rate`` below);
    2. rank the available clients by ``alpha_i^2 / r_i^2`` (descending; ties: lower id first) and select the top
       ``k`` (all of them when fewer are available);
    3. ``w <- w + server_lr * sum_{i received} (alpha_i / r_i) delta_i`` (not renormalised).

    It favours rarely available clients. Three sources of ``r`` (``rate``):

    - ``"exact"``: ``r_i = pi_i``, the oracle stationary availability (the thesis: "all the algorithms rely on the
      exact knowledge of pi"); needs ``pi``.
    - ``"code"``: the authors' released code (``arodio/CA-Fed``, class ``F3AST``): every round
      ``r_i = (1 - beta) pi_i + beta * 1[i available]``, recomputed from the oracle ``pi`` (no memory across
      rounds); needs ``pi``. An available client has ``r_i = (1 - beta) pi_i + beta``.
    - ``"ema"`` (default; an estimator in neither the thesis nor the code): ``r_i <- (1 - beta) r_i + beta *
      1[i available]`` carried across rounds. With ``init_rate=None`` it is bias-corrected (``r`` is the plain
      activity frequency until ``~1/beta`` rounds, then forgets exponentially); otherwise ``r`` starts at
      ``init_rate`` (scalar or ``N`` values in ``(0, 1]``) without correction.

    Args:
        k: clients per round (integer ``>= 1``; the thesis: 45 of 100, CA-Fed's mean included count).
        beta: smoothness in ``(0, 1]`` (thesis ``O(1/T)``; default ``1/200``); unused with ``rate="exact"``.
        rate: ``"ema"``, ``"code"`` or ``"exact"``.
        pi: oracle stationary availabilities (``N`` values in ``(0, 1]``), required by ``"code"`` and ``"exact"``.
        init_rate: initial ``r`` of ``"ema"``, or ``None``.
        server_lr: ``> 0``.

    Example (the authors' code, ``beta = 0.5``)::

        >>> algo = F3AST(k=1, beta=0.5, rate="code", pi=[0.2, 0.6])
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.select(0, torch.tensor([True, True]), None)   # r = [0.6, 0.8]: alpha^2/r^2 favours client 0
        tensor([ True, False])
        >>> algo.rates
        tensor([0.6000, 0.8000], dtype=torch.float64)
    """

    def __init__(
        self,
        k: int,
        beta: float = 0.005,
        init_rate=None,
        server_lr: float = 1.0,
        rate: str = "ema",
        pi=None,
    ) -> None:
        super().__init__(server_lr)
        self.k = check_int(k, "k (clients per round)")
        self.beta = check_real(beta, "beta", 0.0, 1.0, low_open=True)
        self.rate = check_choice(rate, "rate", F3AST_RATES)
        self._pi = None if pi is None else check_vector(pi, "pi", 0.0, 1.0, low_open=True)
        if self.rate != "ema" and self._pi is None:
            raise ValueError(f"F3AST(rate={rate!r}) needs the oracle stationary availabilities pi=[N values in (0, 1]]")
        if self.rate == "ema" and self._pi is not None:
            raise ValueError("pi is only used by rate='code' or rate='exact'; rate='ema' estimates it")
        if self.rate != "ema" and init_rate is not None:
            raise ValueError("init_rate is only used by rate='ema'")
        self._init = None if init_rate is None else check_vector(init_rate, "init_rate", 0.0, 1.0, low_open=True)
        self._ema: Tensor | None = None
        self._norm: Tensor | None = None
        self.last_selected: Tensor | None = None

    def hparams(self) -> dict:
        out = {"k": self.k, "beta": self.beta, "server_lr": self.server_lr}
        if self.rate != "ema":
            out.update(rate=self.rate, pi=self._pi.tolist())
        if self._init is not None:
            out["init_rate"] = self._init.tolist()
        return out

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        n = self.num_clients
        if self._pi is not None:
            check_length(self._pi.numel(), n, "pi")
            # "exact" never changes r; "code" overwrites it every round
            self._ema, self._norm = self._pi.clone(), torch.ones(n, dtype=_F64)
        elif self._init is not None:
            if self._init.numel() != 1:
                check_length(self._init.numel(), n, "init_rate")
            self._ema = self._init.expand(n).clone()
            self._norm = torch.ones(n, dtype=_F64)
        else:
            self._ema = torch.zeros(n, dtype=_F64)
            self._norm = torch.zeros(n, dtype=_F64)

    @property
    def rates(self) -> Tensor:
        """The activity rates ``r_i`` of the current round (float64 ``[N]``; 0 for clients never seen available)."""
        out = torch.zeros_like(self._ema)
        pos = self._norm > 0
        out[pos] = self._ema[pos] / self._norm[pos]
        return out

    def _on_round(self, round: int, available: Tensor) -> None:
        b = self.beta
        if self.rate == "ema":
            self._ema = (1.0 - b) * self._ema + b * available.to(_F64)
            self._norm = (1.0 - b) * self._norm + b
        elif self.rate == "code":
            self._ema = (1.0 - b) * self._pi + b * available.to(_F64)
        r = self.rates
        idx = torch.nonzero(available).flatten()
        score = (self.client_weights[idx] / r[idx]) ** 2
        order = np.argsort(-score.numpy(), kind="stable")[: self.k]
        chosen = torch.zeros(self.num_clients, dtype=torch.bool)
        chosen[idx[torch.from_numpy(order)]] = True
        self.last_selected = chosen

    def _choose(self, available: Tensor) -> Tensor:
        return self.last_selected.clone()

    def _round_weights(self, ctx: RoundContext | None) -> Tensor:
        r = self.rates
        out = torch.zeros(self.num_clients, dtype=_F64)
        pos = r > 0
        out[pos] = self.client_weights[pos] / r[pos]
        return out

    def _rule_state(self) -> dict:
        return {"ema": _clone(self._ema), "norm": _clone(self._norm), "last_selected": _clone(self.last_selected)}

    def _load_rule_state(self, state: dict) -> None:
        self._ema, self._norm = _clone(state["ema"]), _clone(state["norm"])
        self.last_selected = _clone(state["last_selected"])
