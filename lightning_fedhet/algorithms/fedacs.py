"""FedACS (Weng, Ren, Xiao, Skoglund: "Heterogeneity-Aware Client Sampling") and the sampling baselines it is
compared with (:mod:`.sampled_fedavg`, :mod:`.cafedavg`, :mod:`.os_sampling`).

All four rules draw ``K`` clients **independently, with replacement** (the paper's client sampling) and aggregate
anonymously with divisor ``K`` (the paper's rule (3)), whatever arrives::

    w_{t+1} = w_t + server_lr * (1/K) * sum_{m received} c_m * f_m * delta_m

``c_m`` is the number of times client ``m`` was drawn (the strategy trains a client drawn twice once, and the rule
weights its update twice; Algorithm 1 leaves this open) and ``f_m`` a per-rule factor:

================= ================================================ ============ =====================================
rule              sampling probability ``p_m``                      ``f_m``      paper
================= ================================================ ============ =====================================
``FedACS``        ``omega_m / (s_m ||a_m||_1)``, normalised (15)    1            eq. (15), Algorithm 1
``SampledFedAvg`` ``omega_m`` (importance sampling), or given ``p``  1            "FedAvg (IS)", Example 2
``CAFedAvg``      ``omega_m``                                       ``1 / s_m``  c-a-FedAvg, eq. (113)
``OS``            ``omega_m * n_m`` (``n_m`` = update norm)          ``omega/p``  eq. (20)
================= ================================================ ============ =====================================

with ``omega`` the target weights (the ``client_weights`` of :meth:`setup`, i.e. ``|D_m|/|D|`` or uniform, unless
given explicitly), ``s_m = 1 - q_m`` the probability that client ``m``'s update arrives (``q_m`` the *failure*
probability of the paper's unreliable links) and ``||a_m||_1`` its local-solver accumulation norm (``T_m`` for SGD;
:func:`~lightning_fedhet.algorithms.fednova.accumulation_norm` for momentum/proximal SGD). In expectation rule (3)
minimises the surrogate ``sum_m Omega_m F_m`` with ``Omega_m ∝ p_m s_m ||a_m||_1`` (:func:`surrogate_weights`);
FedACS chooses ``p`` so that ``Omega = omega`` exactly, i.e. ``chi^2(omega || Omega) = 0`` (:func:`chi_square`).

**The system oracle.** FedACS needs *this round's* ``s_m`` and ``||a_m||_1`` of every client
**before** it samples, but :meth:`select` runs before :meth:`open_round`. The strategy therefore calls, each round,
**before** ``select``::

    algo.observe_system(t, success_probs=s_t, local_steps=T_t, participation_probs=p)   # tensors [N]

with ``s_t = (1 - q_down)(1 - q_up)`` from the channel and ``T_t`` the local steps every client (not only the
selected ones) *would* run in round ``t`` (a pure function of ``(seed, t)`` in this library). ``accumulation_norms``
may replace ``local_steps`` for solvers whose ``||a||_1`` is computed elsewhere (e.g. LR schedules). Without the
call the rule falls back, with a one-time warning, to the last values it saw (an earlier ``observe_system``, or
``RoundContext.success_probs`` and the ``local_steps`` of selected clients from earlier rounds); values never seen
count as ``s = 1`` and ``||a||_1 = 1`` (mean of the known norms when some are known), so an un-wired FedACS
degrades to importance sampling.

**Online estimator (extension beyond the paper, ``estimator="ema"``).** The paper has no estimator. As
a labelled extension the rules can instead use a bias-corrected exponential moving average (rate ``ema``) of what
the server observes: per client, arrival (``add`` called) of each round it was drawn (estimates ``s_m``), the
``||a||_1`` of the steps it was told to run (``RoundContext.local_steps``), and its availability
(``RoundContext.available``, used with ``unavailable="drop"``). The estimates use rounds ``< t`` only; oracle values
are then ignored. Unseen clients start at ``s = 1`` and at the mean known norm. A client that holds no data (its
``client_sizes`` entry is 0) never trains, so its draws are not counted as failed arrivals: it keeps ``s = 1``, as
with the oracle, instead of ``s -> 0``, which would pull every draw onto it.

**Unavailable clients** (not in the paper, where every client can be drawn and only uploads fail):

- ``unavailable="renormalize"`` (default): the ``K`` draws are made among the available clients only, with ``p``
  restricted to them and renormalised. Identical to the paper when everyone is available; with heterogeneous,
  unknown availability it is biased towards available clients.
- ``unavailable="drop"``: the ``K`` draws are made among **all** clients with the paper's ``p``; a draw that lands on
  an unavailable client is lost exactly like a failed upload (the divisor stays ``K``). If the stationary
  availability ``pi_m`` is known (``participation_probs``) FedACS folds it into the success probability,
  ``s_m -> pi_m s_m``, which keeps ``Omega = omega`` (c-a-FedAvg divides by ``pi_m s_m``).

``last_probabilities`` is the distribution the ``K`` draws were taken from (``[N]``, zero off the support).

**Duplicates and links** (left open by Algorithm 1): a client drawn ``c`` times trains once, its upload succeeds or
fails once (one link draw per distinct client, as the library's channel does), and an arrived update is weighted
``c/K``. Both
readings of line 19 keep the update unbiased. An empty round leaves ``w`` unchanged. ``s_m`` is clamped to
``>= min_success`` so ``p_m`` stays finite.

**OS's update norms** (not fixed by the paper): OS needs ``||delta_m||`` *before* sampling, which only exists
after training. :class:`OS` uses the last **received** update norm of each client (``last_seen``; clients never
received get the mean of the known norms, 1 before any), mixed with ``omega`` by ``mix`` to keep every ``p_m > 0``.
No extra client computation is assumed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fedhet._checks import check_distribution, check_length, check_vector, check_weights
from lightning_fedhet.algorithms._sampler import ESTIMATORS, UNAVAILABLE, SystemEstimator, WithReplacementSampler
from lightning_fedhet.algorithms.cafedavg import CAFedAvg
from lightning_fedhet.algorithms.os_sampling import OS
from lightning_fedhet.algorithms.sampled_fedavg import SampledFedAvg

# The baselines and the estimator lived in this module; their import path keeps working.
__all__ = [
    "FedACS",
    "SampledFedAvg",
    "CAFedAvg",
    "OS",
    "SystemEstimator",
    "fedacs_probabilities",
    "surrogate_weights",
    "chi_square",
    "UNAVAILABLE",
    "ESTIMATORS",
]

_F64 = torch.float64


# ---------------------------------------------------------------------------------------------- analysis helpers
def fedacs_probabilities(omega, success_probs, norms) -> Tensor:
    """FedACS sampling probabilities, eq. (15): ``p_m ∝ omega_m / (s_m ||a_m||_1)``, float64 ``[M]``.

    Args:
        omega: target weights ``omega_m >= 0`` (normalised here), shape ``[M]``.
        success_probs: ``s_m = 1 - q_m`` in ``(0, 1]``, shape ``[M]``.
        norms: ``||a_m||_1 > 0``, shape ``[M]``.

    Example::

        >>> fedacs_probabilities([0.5, 0.5], [1.0, 0.5], [1.0, 8.0])   # ∝ [0.5/1, 0.5/4]
        tensor([0.8000, 0.2000], dtype=torch.float64)
    """
    omega, s, a = _system_vectors(omega, success_probs, norms)
    raw = omega / (s * a)
    return raw / raw.sum()


def surrogate_weights(probabilities, success_probs, norms) -> Tensor:
    """Surrogate weights of rule (3) (the paper's objective-inconsistency analysis), float64 ``[M]``::

        Omega_m = p_m s_m a_m / sum_j p_j s_j a_j
    """
    p = check_weights(probabilities, "probabilities", normalize=False)
    _, s, a = _system_vectors(torch.ones_like(p), success_probs, norms)
    raw = p * s * a
    return raw / raw.sum()


def chi_square(omega, surrogate) -> float:
    """``chi^2(omega || Omega) = sum_m (omega_m - Omega_m)^2 / Omega_m`` (Theorem 2's consistency gap).

    Both vectors are normalised first; terms with ``omega_m = Omega_m = 0`` are 0, and ``inf`` is returned when
    some ``Omega_m = 0 < omega_m`` (client ``m`` can never influence the model).
    """
    omega = check_weights(omega, "omega")
    big = check_weights(surrogate, "surrogate", num_clients=omega.numel())
    if ((big == 0) & (omega > 0)).any():
        return float("inf")
    pos = big > 0
    return float(((omega[pos] - big[pos]) ** 2 / big[pos]).sum())


def _system_vectors(omega, success_probs, norms) -> tuple[Tensor, Tensor, Tensor]:
    """``omega`` normalised, ``s`` in ``(0, 1]`` and ``||a||_1 > 0``, float64 ``[M]`` each."""
    omega = check_weights(omega, "omega")
    n = omega.numel()
    s = check_vector(success_probs, "success_probs", 0.0, 1.0, low_open=True, num_clients=n)
    a = check_vector(norms, "norms", 0.0, math.inf, low_open=True, num_clients=n)
    return omega, s, a


# ---------------------------------------------------------------------------------------------- the rule
class FedACS(WithReplacementSampler):
    """FedACS: sample ``K`` clients with replacement from ``p_m ∝ omega_m / (s_m ||a_m||_1)`` (eq. 15), ÷K.

    Decisions on what the paper leaves open are in the module docstring: the system oracle :meth:`observe_system`
    called before :meth:`select`, unavailable clients (``unavailable``), one link draw per distinct client with
    updates weighted by their draw count, ``P(success) = 1 - q``, ``||a||_1`` from the local solver in closed form
    (the paper's generalised local update), the labelled EMA extension (``estimator="ema"``), and App. I.2's per-round
    step calibration (``calibrate``: the clients' learning rate, as the paper writes it, or the server step).

    Args:
        K: draws per round (integer ``>= 1``; the paper's experiments: 0.3 M).
        omega: target weights (explicit probabilities, must sum to 1); default the ``client_weights`` of
            :meth:`setup` (``|D_m|/|D|`` or uniform).
        momentum: local SGD momentum ``rho`` in ``[0, 1)`` (for ``||a||_1``).
        prox_mu: FedProx coefficient ``mu >= 0`` of the local solver (needs ``local_lr``).
        local_lr: client learning rate (only for ``prox_mu > 0``).
        estimator: ``None`` (system oracle via :meth:`observe_system`, the paper) or ``"ema"`` (extension: online
            estimates, see the module doc).
        ema: rate of the EMA estimator.
        unavailable: ``"renormalize"`` (draw among available clients) or ``"drop"`` (draws on unavailable clients
            are lost); see the module doc.
        calibrate: App. I.2's step calibration, recomputed every round from that round's ``s`` and ``||a||_1``: the
            factor ``c = [sum omega s a][sum omega/(s a)] >= 1`` that gives FedACS FedAvg's effective step
            (:mod:`.calibration`). ``True`` or ``"client"`` multiplies **every client's learning rate** by ``c`` for
            the round, as the paper writes it (it adjusts ``eta``; the engines scale the optimizer's ``lr``).
            ``"server"`` multiplies the server step instead; that is first-order equivalent only while
            ``eta * ||a||_1`` is small. When client updates saturate with local steps (many steps, a large ``eta``)
            the server variant turns the average into an extrapolation: with ``c`` of 2.4-10.5 it put weights up to
            4 on single updates and collapsed the Fashion-MNIST study to chance. A warning fires when one update's
            weight exceeds 1. ``False`` (default): Algorithm 1 as printed, no calibration.
        calibration_cap: upper bound on ``c`` (``None``: uncapped), for either target.
        server_lr: server step ``> 0`` multiplying the aggregate (the paper: 1, its ``eta`` being the local lr).
        min_success: floor on ``s_m`` (keeps ``p_m`` finite).

    Wiring (select runs before open_round, so the oracle comes first)::

        algo.observe_system(t, success_probs=s_t, local_steps=T_t)   # every client's q and T of round t
        counts = algo.select(t, available, rng)                     # int64 [N]; train clients with count > 0 once
        algo.open_round(t, ctx); algo.add(i, delta_i, info) ...; w = algo.close_round()

    Example::

        >>> import numpy as np
        >>> algo = FedACS(K=4)
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.observe_system(0, success_probs=[1.0, 0.5], local_steps=[1, 8])
        >>> algo.select(0, torch.tensor([True, True]), np.random.default_rng(0)).sum().item()
        4
        >>> algo.last_probabilities       # ∝ 0.5/(1*1), 0.5/(0.5*8)
        tensor([0.8000, 0.2000], dtype=torch.float64)
    """

    uses_system = True
    calibration_method = "fedacs"

    def __init__(
        self,
        K: int,
        omega=None,
        momentum: float = 0.0,
        prox_mu: float = 0.0,
        local_lr: float | None = None,
        estimator: str | None = None,
        ema: float = 0.1,
        unavailable: str = "renormalize",
        calibrate: bool | str = False,
        calibration_cap: float | None = None,
        server_lr: float = 1.0,
        min_success: float = 1e-6,
    ) -> None:
        super().__init__(K, unavailable, server_lr, estimator, ema, momentum, prox_mu, local_lr, min_success,
                         calibrate, calibration_cap)
        self._omega_given = None if omega is None else check_distribution(omega, "omega")

    def hparams(self) -> dict:
        out = super().hparams()
        if self._omega_given is not None:
            out["omega"] = self._omega_given.tolist()
        if self.momentum or self.prox_mu:
            out.update(momentum=self.momentum, prox_mu=self.prox_mu, local_lr=self.local_lr)
        return out

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        if self._omega_given is not None:
            check_length(self._omega_given.numel(), self.num_clients, "omega")

    @property
    def omega(self) -> Tensor:
        """Target weights ``omega`` (float64 ``[N]``, summing to 1)."""
        self._check_ready()
        return (self.client_weights if self._omega_given is None else self._omega_given).clone()

    def probabilities(self, success_probs, norms) -> Tensor:
        """Eq. (15) over all clients for given ``s`` and ``||a||_1`` (float64 ``[N]``)."""
        return fedacs_probabilities(self.omega, success_probs, norms)

    def _uses_norms(self) -> bool:
        return True

    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        return self.omega / (system["success"] * system["norms"])

    def _calibration_weights(self) -> Tensor:
        return self.omega
