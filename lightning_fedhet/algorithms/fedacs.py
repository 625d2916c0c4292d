"""FedACS (Weng, Ren, Xiao, Skoglund: "Heterogeneity-Aware Client Sampling"; spec ``shared/specs/fedacs.md``) and
the sampling baselines it is compared with.

All four rules draw ``K`` clients **independently, with replacement** (spec §1.2) and aggregate anonymously with
divisor ``K`` (rule (3), spec §1.5), whatever arrives::

    w_{t+1} = w_t + server_lr * (1/K) * sum_{m received} c_m * f_m * delta_m

``c_m`` is the number of times client ``m`` was drawn (the strategy trains a client drawn twice once, and the rule
weights its update twice, spec §2.7) and ``f_m`` a per-rule factor:

================= ================================================ ============ =====================================
rule              sampling probability ``p_m``                      ``f_m``      spec
================= ================================================ ============ =====================================
``FedACS``        ``omega_m / (s_m ||a_m||_1)``, normalised (15)    1            §2.1, Algorithm 1
``SampledFedAvg`` ``omega_m`` (importance sampling), or given ``p``  1            §3.1 "FedAvg (IS)"
``CAFedAvg``      ``omega_m``                                       ``1 / s_m``  §3.2 c-a-FedAvg, eq. (113)
``OS``            ``omega_m * n_m`` (``n_m`` = update norm)          ``omega/p``  §3.6, eq. (20)
================= ================================================ ============ =====================================

with ``omega`` the target weights (the ``client_weights`` of :meth:`setup`, i.e. ``|D_m|/|D|`` or uniform, unless
given explicitly), ``s_m = 1 - q_m`` the probability that client ``m``'s update arrives (``q_m`` the *failure*
probability, spec §1.4) and ``||a_m||_1`` its local-solver accumulation norm (``T_m`` for SGD;
:func:`~lightning_fedhet.algorithms.fednova.accumulation_norm` for momentum/proximal SGD). In expectation rule (3)
minimises the surrogate ``sum_m Omega_m F_m`` with ``Omega_m ∝ p_m s_m ||a_m||_1`` (:func:`surrogate_weights`);
FedACS chooses ``p`` so that ``Omega = omega`` exactly, i.e. ``chi^2(omega || Omega) = 0`` (:func:`chi_square`).

**The system oracle (spec §2.3, §6.2.1).** FedACS needs *this round's* ``s_m`` and ``||a_m||_1`` of every client
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

**Online estimator (extension beyond the paper, ``estimator="ema"``).** The paper has no estimator (spec §2.3). As
a labelled extension the rules can instead use a bias-corrected exponential moving average (rate ``ema``) of what
the server observes: per client, arrival (``add`` called) of each round it was drawn (estimates ``s_m``), the
``||a||_1`` of the steps it was told to run (``RoundContext.local_steps``), and its availability
(``RoundContext.available``, used with ``unavailable="drop"``). The estimates use rounds ``< t`` only; oracle values
are then ignored. Unseen clients start at ``s = 1`` and at the mean known norm.

**Unavailable clients** (not in the paper, where every client can be drawn and only uploads fail):

- ``unavailable="renormalize"`` (default): the ``K`` draws are made among the available clients only, with ``p``
  restricted to them and renormalised. Identical to the paper when everyone is available; with heterogeneous,
  unknown availability it is biased towards available clients.
- ``unavailable="drop"``: the ``K`` draws are made among **all** clients with the paper's ``p``; a draw that lands on
  an unavailable client is lost exactly like a failed upload (the divisor stays ``K``). If the stationary
  availability ``pi_m`` is known (``participation_probs``) FedACS folds it into the success probability,
  ``s_m -> pi_m s_m``, which keeps ``Omega = omega`` (c-a-FedAvg divides by ``pi_m s_m``).

``last_probabilities`` is the distribution the ``K`` draws were taken from (``[N]``, zero off the support).

**Duplicates and links** (spec §2.7): a client drawn ``c`` times trains once, its upload succeeds or fails once (one
link draw per distinct client, as the library's channel does), and an arrived update is weighted ``c/K``. Both
readings of line 19 keep the update unbiased. An empty round leaves ``w`` unchanged. ``s_m`` is clamped to
``>= min_success`` so ``p_m`` stays finite (spec §2.7).

**OS's update norms** (spec §3.6, ``os_norm_source``): OS needs ``||delta_m||`` *before* sampling, which only exists
after training. :class:`OS` uses the last **received** update norm of each client (``last_seen``; clients never
received get the mean of the known norms, 1 before any), mixed with ``omega`` by ``mix`` to keep every ``p_m > 0``.
No extra client computation is assumed.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import (
    as_int_array,
    check_choice,
    check_distribution,
    check_int,
    check_length,
    check_mask,
    check_real,
    check_vector,
    check_weights,
    per_client,
)
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares
from lightning_fedhet.algorithms.calibration import lr_scalings
from lightning_fedhet.algorithms.fednova import accumulation_norm, check_local_solver

UNAVAILABLE = ("renormalize", "drop")
ESTIMATORS = (None, "ema")
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
    """Surrogate weights of rule (3), spec §1.6: ``Omega_m = p_m s_m a_m / sum_j p_j s_j a_j``, float64 ``[M]``."""
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


def _clone(x):
    return None if x is None else x.clone()


# ---------------------------------------------------------------------------------------------- EMA estimator
class SystemEstimator:
    """Bias-corrected EMAs of what the server observes (an extension beyond the FedACS paper).

    Per client it tracks the arrival indicator of each round the client was drawn (estimates ``s_m``), the
    accumulation norm of the steps it was told to run (estimates ``||a_m||_1``) and its availability (estimates
    ``pi_m``). Each EMA is ``v <- (1-b) v + b x`` with the bias-correcting weight ``u <- (1-b) u + b``, estimate
    ``v/u`` (the plain mean of the first observations, then exponentially forgetting; like Adam's correction).

    Args:
        rate: EMA rate ``b`` in ``(0, 1]`` (1 = last observation only).
    """

    def __init__(self, rate: float = 0.1) -> None:
        self.rate = check_real(rate, "ema (the estimator's rate)", 0.0, 1.0, low_open=True)
        self.num_clients = 0
        self.state: dict[str, Tensor] = {}

    def setup(self, num_clients: int) -> None:
        self.num_clients = int(num_clients)
        z = torch.zeros(self.num_clients, dtype=_F64)
        self.state = {k: z.clone() for k in ("s_v", "s_u", "a_v", "a_u", "pi_v", "pi_u")}

    def _ema(self, key: str, mask: Tensor, x: Tensor) -> None:
        b = self.rate
        v, u = self.state[key + "_v"], self.state[key + "_u"]
        v[mask] = (1 - b) * v[mask] + b * x[mask]
        u[mask] = (1 - b) * u[mask] + b

    def update(self, drawn: Tensor, arrived: Tensor, available: Tensor | None, norms: Tensor | None) -> None:
        """One round: ``drawn``/``arrived``/``available`` bool ``[N]``; ``norms`` float ``[N]`` (nan = not seen)."""
        self._ema("s", drawn, arrived.to(_F64))
        if norms is not None:
            self._ema("a", torch.isfinite(norms) & (norms > 0), torch.nan_to_num(norms, nan=0.0))
        if available is not None:
            self._ema("pi", torch.ones(self.num_clients, dtype=torch.bool), available.to(_F64))

    def _estimate(self, key: str, prior: float) -> Tensor:
        v, u = self.state[key + "_v"], self.state[key + "_u"]
        seen = u > 0
        out = torch.full((self.num_clients,), prior, dtype=_F64)
        out[seen] = v[seen] / u[seen]
        return out

    def success(self) -> Tensor:
        """Estimated ``s_m`` (1 for clients never drawn)."""
        return self._estimate("s", 1.0)

    def availability(self) -> Tensor:
        """Estimated ``pi_m`` (1 before the first round)."""
        return self._estimate("pi", 1.0)

    def norms(self) -> Tensor:
        """Estimated ``||a_m||_1`` (mean of the known estimates, or 1, for clients never told to train)."""
        seen = self.state["a_u"] > 0
        prior = float((self.state["a_v"][seen] / self.state["a_u"][seen]).mean()) if seen.any() else 1.0
        return self._estimate("a", prior)

    def state_dict(self) -> dict:
        return {"rate": self.rate, "num_clients": self.num_clients, **{k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rate = float(state["rate"])
        self.num_clients = int(state["num_clients"])
        self.state = {k: state[k].clone() for k in ("s_v", "s_u", "a_v", "a_u", "pi_v", "pi_u")}


# ---------------------------------------------------------------------------------------------- shared sampler
class _WithReplacementSampler(Algorithm):
    """K draws with replacement from ``p``; anonymous aggregation ``(1/K) sum c_m f_m delta_m`` (rule (3))."""

    selects_clients = True
    shares_rounds = True
    uses_system = False  # whether the sampling probabilities need this round's oracle values (FedACS: True)

    def __init__(
        self,
        K: int,
        unavailable: str = "renormalize",
        server_lr: float = 1.0,
        estimator: str | None = None,
        ema: float = 0.1,
        momentum: float = 0.0,
        prox_mu: float = 0.0,
        local_lr: float | None = None,
        min_success: float = 1e-6,
    ) -> None:
        super().__init__()
        self.K = check_int(K, "K (number of draws per round)")
        self.unavailable = check_choice(unavailable, "unavailable", UNAVAILABLE)
        self.server_lr = check_real(server_lr, "server_lr", 0.0, math.inf, low_open=True)
        self.estimator_name = check_choice(estimator, "estimator", ESTIMATORS)
        check_local_solver(momentum, prox_mu, local_lr)
        self.min_success = check_real(min_success, "min_success", 0.0, 1.0, low_open=True)
        self.estimator = SystemEstimator(ema) if estimator == "ema" else None
        self.ema = float(ema)
        self.momentum = float(momentum)
        self.prox_mu = float(prox_mu)
        self.local_lr = None if local_lr is None else float(local_lr)
        self._prox = self.prox_mu * self.local_lr if self.prox_mu > 0 else 0.0
        self.last_probabilities: Tensor | None = None
        self.last_counts: Tensor | None = None
        self.last_system: dict[str, Tensor] | None = None
        self._counts_round: int | None = None
        self._known: dict[str, Tensor | None] = {"success": None, "norms": None, "participation": None}
        self._observed_round: int | None = None
        self._warned = False
        self._sum: Tensor | None = None
        self._raw: dict[int, float] = {}
        self._factors: Tensor | None = None
        self._step_scale = 1.0
        self._norm_cache: dict[int, float] = {}

    def hparams(self) -> dict:
        out = {"K": self.K, "unavailable": self.unavailable, "server_lr": self.server_lr}
        if self.estimator_name is not None:
            out.update(estimator=self.estimator_name, ema=self.ema)
        return out

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        if self.estimator is not None:
            self.estimator.setup(self.num_clients)

    # ------------------------------------------------------------------ system knowledge
    def norms_from_steps(self, local_steps) -> Tensor:
        """``||a||_1`` of this rule's local solver for each entry of ``local_steps`` (ints >= 1), float64."""
        steps = torch.as_tensor(local_steps).flatten().cpu()
        out = torch.empty(steps.numel(), dtype=_F64)
        for k in torch.unique(steps).tolist():
            if k not in self._norm_cache:
                self._norm_cache[k] = accumulation_norm(int(k), self.momentum, self._prox)
            out[steps == k] = self._norm_cache[k]
        return out

    def observe_system(
        self,
        round: int,
        *,
        success_probs=None,
        local_steps=None,
        participation_probs=None,
        accumulation_norms=None,
    ) -> None:
        """The system oracle for round ``round``; call it **before** :meth:`select` of that round.

        Args:
            round: the round the values are for.
            success_probs: ``s_m = 1 - q_m^{(t)}`` in ``[0, 1]`` per client (``[N]`` or scalar).
            local_steps: local steps ``T_m^{(t)} >= 1`` every client would run this round (``[N]`` or scalar).
            participation_probs: stationary availability ``pi_m`` in ``[0, 1]`` (used with ``unavailable="drop"``).
            accumulation_norms: ``||a_m^{(t)}||_1 > 0`` directly, instead of ``local_steps``.

        Values not given keep their last known value.
        """
        self._check_ready()
        n = self.num_clients
        if success_probs is not None:
            self._known["success"] = check_vector(success_probs, "success_probs", 0.0, 1.0, num_clients=n)
        if local_steps is not None and accumulation_norms is not None:
            raise ValueError("give local_steps or accumulation_norms, not both")
        if local_steps is not None:
            steps = per_client(as_int_array(local_steps, "local_steps"), n, "local_steps")
            self._known["norms"] = self.norms_from_steps(torch.from_numpy(steps).to(torch.int64))
        if accumulation_norms is not None:
            self._known["norms"] = check_vector(accumulation_norms, "accumulation_norms", 0.0, math.inf, low_open=True,
                                                num_clients=n)
        if participation_probs is not None:
            self._known["participation"] = check_vector(participation_probs, "participation_probs", 0.0, 1.0,
                                                        num_clients=n)
        self._observed_round = int(round)

    def _system(self, round: int) -> dict[str, Tensor]:
        """``success`` (availability folded in under ``unavailable="drop"``) and ``norms`` used this round."""
        n = self.num_clients
        if self.estimator is not None:
            s, a, pi = self.estimator.success(), self.estimator.norms(), self.estimator.availability()
        else:
            if self._observed_round != round and self.uses_system and not self._warned:
                warnings.warn(
                    f"{type(self).__name__}.select(round={round}) without observe_system({round}): using the last "
                    "known success probabilities and local steps (spec fedacs.md §2.3 needs this round's values)",
                    stacklevel=3,
                )
                self._warned = True
            ones = torch.ones(n, dtype=_F64)
            s = ones if self._known["success"] is None else self._known["success"]
            a = self._known["norms"]
            if a is None:
                a = ones
            elif not torch.isfinite(a).all():
                known = torch.isfinite(a)
                a = torch.where(known, a, a[known].mean() if known.any() else torch.tensor(1.0, dtype=_F64))
            pi = ones if self._known["participation"] is None else self._known["participation"]
        if self.unavailable == "drop":
            s = s * pi
        return {"success": s.clamp(min=self.min_success, max=1.0), "norms": a.clamp(min=1e-12)}

    # ------------------------------------------------------------------ rule hooks
    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        """Unnormalised sampling weights over all ``N`` clients (float64, >= 0)."""
        raise NotImplementedError

    def _round_factors(self, probs: Tensor, system: dict[str, Tensor], ctx: RoundContext | None) -> Tensor:
        """Per-client factor ``f_m`` of this round (float64 ``[N]``)."""
        return torch.ones(self.num_clients, dtype=_F64)

    def _round_step_scale(self, system: dict[str, Tensor]) -> float:
        return 1.0

    # ------------------------------------------------------------------ protocol
    def select(self, round: int, available: Tensor, rng: np.random.Generator) -> Tensor:
        """Draw ``K`` clients with replacement; returns int64 counts ``[N]`` (0 off the sample)."""
        self._check_ready()
        avail = check_mask(available, self.num_clients, "available")
        system = self._system(round)
        scores = self._scores(system).clone()
        if self.unavailable == "renormalize":
            scores[~avail] = 0.0
        total = float(scores.sum())
        probs = scores / total if total > 0 else torch.zeros_like(scores)
        counts = torch.zeros(self.num_clients, dtype=torch.int64)
        if total > 0:
            counts = torch.from_numpy(rng.multinomial(self.K, probs.numpy()).astype(np.int64))
            counts[~avail] = 0  # unavailable="drop": those draws are lost like failed uploads
        self.last_probabilities = probs
        self.last_counts = counts.clone()
        self.last_system = {k: v.clone() for k, v in system.items()}
        self._counts_round = int(round)
        return counts

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        if self._counts_round != int(round):
            raise RuntimeError(
                f"{type(self).__name__}: select() must be called for round {round} before open_round({round}); "
                "updates are weighted by their number of draws"
            )
        if ctx is not None and self.estimator is None:
            if ctx.success_probs is not None:
                self._known["success"] = check_vector(ctx.success_probs, "success_probs", 0.0, 1.0,
                                                      num_clients=self.num_clients)
            if ctx.participation_probs is not None and self._known["participation"] is None:
                self._known["participation"] = check_vector(ctx.participation_probs, "participation_probs", 0.0, 1.0,
                                                            num_clients=self.num_clients)
            if ctx.local_steps is not None:
                steps = torch.as_tensor(ctx.local_steps).flatten().cpu().to(torch.int64)
                told = steps > 0
                if told.any():
                    norms = self._known["norms"]
                    if norms is None:
                        norms = torch.full((self.num_clients,), float("nan"), dtype=_F64)
                    norms = norms.clone()
                    norms[told] = self.norms_from_steps(steps[told])
                    self._known["norms"] = norms
        self._factors = self._round_factors(self.last_probabilities, self.last_system, ctx)
        self._step_scale = self._round_step_scale(self.last_system)
        self._sum = torch.zeros_like(self.params)
        self._raw = {}

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._raw)
        count = int(self.last_counts[client])
        if count == 0:
            raise ValueError(f"client {client} was not drawn by select() in round {self._counts_round}")
        raw = count * float(self._factors[client]) / self.K
        self._raw[client] = raw
        self._sum.add_(delta.to(self._sum), alpha=raw)
        self._after_add(client, delta)

    def _after_add(self, client: int, delta: Tensor) -> None:
        pass

    def round_shares(self) -> RoundShares:
        return RoundShares(sums=[self._sum], tables=[self._raw])

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        if self._raw:
            self.params = self.params + (self.server_lr * self._step_scale) * self._sum
        self.last_weights = {c: r * self._step_scale for c, r in self._raw.items()}
        if self.estimator is not None:
            arrived = torch.zeros(self.num_clients, dtype=torch.bool)
            if self._raw:
                arrived[list(self._raw)] = True
            ctx = self.ctx
            norms = None
            if ctx is not None and ctx.local_steps is not None:
                steps = torch.as_tensor(ctx.local_steps).flatten().cpu().to(torch.int64)
                norms = torch.full((self.num_clients,), float("nan"), dtype=_F64)
                if (steps > 0).any():
                    norms[steps > 0] = self.norms_from_steps(steps[steps > 0])
            available = None if ctx is None else torch.as_tensor(ctx.available).flatten().cpu() != 0
            self.estimator.update(self.last_counts > 0, arrived, available, norms)
        self._sum = None
        return self.params

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["sampler"] = {
            "last_probabilities": _clone(self.last_probabilities),
            "last_counts": _clone(self.last_counts),
            "last_system": None if self.last_system is None else {k: v.clone() for k, v in self.last_system.items()},
            "counts_round": self._counts_round,
            "known": {k: _clone(v) for k, v in self._known.items()},
            "observed_round": self._observed_round,
            "warned": self._warned,
            "estimator": None if self.estimator is None else self.estimator.state_dict(),
            "extra": self._extra_state(),
        }
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        s = state["sampler"]
        self.last_probabilities = _clone(s["last_probabilities"])
        self.last_counts = _clone(s["last_counts"])
        self.last_system = None if s["last_system"] is None else {k: v.clone() for k, v in s["last_system"].items()}
        self._counts_round = s["counts_round"]
        self._known = {k: _clone(v) for k, v in s["known"].items()}
        self._observed_round = s["observed_round"]
        self._warned = bool(s["warned"])
        if (self.estimator is None) != (s["estimator"] is None):
            raise ValueError(f"state was saved with estimator={'ema' if s['estimator'] else None!r} "
                             f"but this rule has estimator={self.estimator_name!r}")
        if self.estimator is not None:
            self.estimator.load_state_dict(s["estimator"])
        self._load_extra_state(s["extra"])

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass


# ---------------------------------------------------------------------------------------------- the rules
class FedACS(_WithReplacementSampler):
    """FedACS: sample ``K`` clients with replacement from ``p_m ∝ omega_m / (s_m ||a_m||_1)`` (eq. 15), ÷K.

    Decisions on the spec's open points are in the module docstring: the system oracle :meth:`observe_system`
    called before :meth:`select` (§2.3, §6.2.1), unavailable clients (``unavailable``), one link draw per distinct
    client with updates weighted by their draw count (§2.7), ``P(success) = 1 - q`` (§1.4), ``||a||_1`` from the
    local solver in closed form (§1.3), the labelled EMA extension (``estimator="ema"``), and per-round step
    calibration applied to the server step (``calibrate``, §3.7).

    Args:
        K: draws per round (integer ``>= 1``; the paper's experiments: 0.3 M).
        omega: target weights (explicit probabilities, must sum to 1); default the ``client_weights`` of
            :meth:`setup` (``|D_m|/|D|`` or uniform).
        momentum: local SGD momentum ``rho`` in ``[0, 1)`` (for ``||a||_1``, spec §1.3).
        prox_mu: FedProx coefficient ``mu >= 0`` of the local solver (needs ``local_lr``).
        local_lr: client learning rate (only for ``prox_mu > 0``).
        estimator: ``None`` (system oracle via :meth:`observe_system`, the paper) or ``"ema"`` (extension: online
            estimates, see the module doc).
        ema: rate of the EMA estimator.
        unavailable: ``"renormalize"`` (draw among available clients) or ``"drop"`` (draws on unavailable clients
            are lost); see the module doc.
        calibrate: multiply the server step each round by App. I.2's factor
            ``[sum omega s a][sum omega/(s a)]`` so FedACS takes FedAvg's effective step (:mod:`.calibration`).
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
        calibrate: bool = False,
        server_lr: float = 1.0,
        min_success: float = 1e-6,
    ) -> None:
        super().__init__(K, unavailable, server_lr, estimator, ema, momentum, prox_mu, local_lr, min_success)
        self._omega_given = None if omega is None else check_distribution(omega, "omega")
        self.calibrate = bool(calibrate)

    def hparams(self) -> dict:
        out = super().hparams()
        if self._omega_given is not None:
            out["omega"] = self._omega_given.tolist()
        if self.momentum or self.prox_mu:
            out.update(momentum=self.momentum, prox_mu=self.prox_mu, local_lr=self.local_lr)
        if self.calibrate:
            out["calibrate"] = True
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

    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        return self.omega / (system["success"] * system["norms"])

    def _round_step_scale(self, system: dict[str, Tensor]) -> float:
        if not self.calibrate:
            return 1.0
        return lr_scalings(self.omega, system["success"], system["norms"], target="server")["fedacs"].server


class SampledFedAvg(_WithReplacementSampler):
    """FedAvg with importance sampling (the FedACS paper's FedAvg, spec §3.1): ``K`` draws from ``p = omega``, ÷K.

    Args:
        K: draws per round (integer ``>= 1``).
        probabilities: fixed sampling probabilities (must sum to 1); default ``omega`` = the ``client_weights`` of
            :meth:`setup`. With ``p != omega`` this is the generic anonymous rule (3) whose surrogate is
            ``Omega ∝ p s ||a||_1``.
        unavailable: ``"renormalize"`` or ``"drop"`` (module doc).
        server_lr: ``> 0``.

    Example::

        >>> import numpy as np
        >>> algo = SampledFedAvg(K=2, probabilities=[1.0, 0.0])
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.select(0, torch.tensor([True, True]), np.random.default_rng(0))
        tensor([2, 0])
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([3.0]), ClientInfo(num_samples=1, local_steps=1))
        >>> algo.close_round()          # drawn twice: 2/K * 3
        tensor([3.])
    """

    def __init__(self, K: int, probabilities=None, unavailable: str = "renormalize", server_lr: float = 1.0) -> None:
        super().__init__(K, unavailable, server_lr)
        self._probs_given = None if probabilities is None else check_distribution(probabilities, "probabilities")

    def hparams(self) -> dict:
        out = super().hparams()
        if self._probs_given is not None:
            out["probabilities"] = self._probs_given.tolist()
        return out

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        if self._probs_given is not None:
            check_length(self._probs_given.numel(), self.num_clients, "probabilities")

    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        return (self.client_weights if self._probs_given is None else self._probs_given).clone()


class CAFedAvg(_WithReplacementSampler):
    """c-a-FedAvg ("communication-aware FedAvg", Perazzone et al.; FedACS paper eq. (113), spec §3.2).

    Importance sampling ``p = omega`` (``K`` draws with replacement) and each received update divided by its
    success probability: ``w + (1/K) sum_{received} c_m delta_m / s_m``. Removes the communication bias only
    (``Omega ∝ omega ||a||_1`` remains). ``s_m`` is ``RoundContext.success_probs`` of the round (the paper's known
    ``q``), else the last value from :meth:`observe_system`, else 1; with ``estimator="ema"`` the EMA estimate
    (extension). Under ``unavailable="drop"`` the divisor is ``pi_m s_m``.

    Args:
        K: draws per round (integer ``>= 1``).
        unavailable: ``"renormalize"`` or ``"drop"``.
        calibrate: multiply the server step by App. I.2's ``sum omega s a / sum omega a`` each round (needs ``||a||``
            from :meth:`observe_system` or the context).
        momentum, prox_mu, local_lr: local solver (for ``||a||_1`` in the calibration only).
        estimator, ema: as in :class:`FedACS`.
        server_lr: ``> 0``.
    """

    def __init__(
        self,
        K: int,
        unavailable: str = "renormalize",
        calibrate: bool = False,
        momentum: float = 0.0,
        prox_mu: float = 0.0,
        local_lr: float | None = None,
        estimator: str | None = None,
        ema: float = 0.1,
        server_lr: float = 1.0,
        min_success: float = 1e-6,
    ) -> None:
        super().__init__(K, unavailable, server_lr, estimator, ema, momentum, prox_mu, local_lr, min_success)
        self.calibrate = bool(calibrate)

    def hparams(self) -> dict:
        out = super().hparams()
        if self.calibrate:
            out["calibrate"] = True
        return out

    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        return self.client_weights.clone()

    def _round_factors(self, probs: Tensor, system: dict[str, Tensor], ctx: RoundContext | None) -> Tensor:
        s = system["success"]
        if self.estimator is None and ctx is not None and ctx.success_probs is not None:
            s = self._known["success"].clamp(min=self.min_success)  # just refreshed from ctx in open_round
            if self.unavailable == "drop" and self._known["participation"] is not None:
                s = (s * self._known["participation"]).clamp(min=self.min_success)
        return 1.0 / s

    def _round_step_scale(self, system: dict[str, Tensor]) -> float:
        if not self.calibrate:
            return 1.0
        return lr_scalings(self.client_weights, system["success"], system["norms"], target="server")["cafedavg"].server


class OS(_WithReplacementSampler):
    """Optimal client sampling (Chen, Horváth, Richtárik; FedACS paper eq. (20), spec §3.6).

    ``K`` draws with replacement from ``p_m ∝ omega_m n_m`` where ``n_m`` is the norm of client ``m``'s last
    *received* update (``os_norm_source="last_seen"``; never-received clients use the mean known norm, 1 before
    any), mixed as ``p = (1 - mix) p_norm + mix * omega``; aggregation ``w + (1/K) sum_{received} c_m (omega_m /
    p_m) delta_m`` with ``p_m`` the probability the draws were taken from (so the aggregate is unbiased for
    ``sum omega_m delta_m`` over the clients that could be drawn, before link failures).

    Args:
        K: draws per round (integer ``>= 1``).
        mix: weight of ``omega`` in the mixture, in ``[0, 1)`` (0 = the pure rule).
        unavailable: ``"renormalize"`` or ``"drop"``.
        server_lr: ``> 0``.
    """

    def __init__(self, K: int, mix: float = 0.0, unavailable: str = "renormalize", server_lr: float = 1.0) -> None:
        super().__init__(K, unavailable, server_lr)
        self.mix = check_real(mix, "mix", 0.0, 1.0, high_open=True)
        self.update_norms: Tensor | None = None  # float64 [N], nan = never received
        self._round_norms: dict[int, float] = {}  # this round's received norms, written at close_round

    def hparams(self) -> dict:
        return {**super().hparams(), "mix": self.mix}

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        self.update_norms = torch.full((self.num_clients,), float("nan"), dtype=_F64)

    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        norms = self.update_norms
        known = torch.isfinite(norms)
        fill = float(norms[known].mean()) if known.any() else 1.0
        raw = self.client_weights * torch.where(known, norms, torch.tensor(fill, dtype=_F64))
        if not raw.sum() > 0:  # every known update was exactly zero: fall back to importance sampling
            raw = self.client_weights.clone()
        return (1.0 - self.mix) * raw / raw.sum() + self.mix * self.client_weights

    def _round_factors(self, probs: Tensor, system: dict[str, Tensor], ctx: RoundContext | None) -> Tensor:
        out = torch.zeros(self.num_clients, dtype=_F64)
        pos = probs > 0
        out[pos] = self.client_weights[pos] / probs[pos]
        return out

    def _after_add(self, client: int, delta: Tensor) -> None:
        self._round_norms[client] = float(torch.linalg.vector_norm(delta.detach().to(_F64)))

    def round_shares(self) -> RoundShares:
        shares = super().round_shares()
        shares.tables.append(self._round_norms)
        return shares

    def close_round(self) -> Tensor:
        # the norms are only read by the next round's select(), so they can be written once the round closes
        for client, norm in self._round_norms.items():
            self.update_norms[client] = norm
        self._round_norms = {}
        return super().close_round()

    def _extra_state(self) -> dict:
        return {"update_norms": _clone(self.update_norms)}

    def _load_extra_state(self, state: dict) -> None:
        self.update_norms = _clone(state["update_norms"])
