"""The machinery shared by the FedACS family (:mod:`~lightning_fedhet.algorithms.fedacs`): ``K`` draws with
replacement, anonymous aggregation with divisor ``K`` (rule (3) of the FedACS paper), the system oracle and the
labelled EMA extension (:class:`SystemEstimator`).
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
    check_int,
    check_mask,
    check_real,
    check_vector,
    per_client,
)
from lightning_fedhet.algorithms._system_estimator import SystemEstimator
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares
from lightning_fedhet.algorithms.calibration import lr_scalings
from lightning_fedhet.algorithms.fednova import accumulation_norm, check_local_solver, check_optimizer_matches

UNAVAILABLE = ("renormalize", "drop")
ESTIMATORS = (None, "ema")
#: where App. I.2's step calibration acts: ``"client"`` (the paper: every client's learning rate ``eta``) or
#: ``"server"`` (the server step; first-order equivalent only while ``eta * ||a||_1`` is small, see ``calibrate``)
CALIBRATION_TARGETS = ("client", "server")
MAX_DRAWS = 10**9
__all__ = ["WithReplacementSampler", "SystemEstimator", "UNAVAILABLE", "ESTIMATORS", "CALIBRATION_TARGETS"]
_F64 = torch.float64


def _clone(x):
    return None if x is None else x.clone()


def _check_calibrate(calibrate, method: str | None) -> bool | str:
    """``calibrate`` as ``False``, ``"client"`` or ``"server"`` (``True`` means ``"client"``, the paper's reading)."""
    if calibrate is False or calibrate is None:
        return False
    if calibrate is True:
        calibrate = "client"
    check_choice(calibrate, "calibrate", CALIBRATION_TARGETS, alternatives="False, True (= 'client')")
    if method is None:
        raise ValueError("calibrate: this rule has no step calibration (App. I.2 covers FedACS and c-a-FedAvg)")
    return calibrate


# ---------------------------------------------------------------------------------------------- shared sampler
class WithReplacementSampler(Algorithm):
    """K draws with replacement from ``p``; anonymous aggregation ``(1/K) sum c_m f_m delta_m`` (rule (3)).

    Subclasses give the sampling scores (:meth:`_scores`) and, optionally, the per-client factor ``f_m``
    (:meth:`_round_factors`), a per-round server-step multiplier (:meth:`_round_step_scale`) and a hook on every
    arrived update (:meth:`_after_add`). See :mod:`lightning_fedhet.algorithms.fedacs` for the model.
    """

    selects_clients = True
    shares_rounds = True
    uses_system = False  # whether the sampling probabilities need this round's oracle values (FedACS: True)
    #: the row of :func:`~lightning_fedhet.algorithms.calibration.lr_scalings` whose multiplier ``calibrate`` applies
    #: (``None``: the rule has no calibration)
    calibration_method: str | None = None

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
        calibrate: bool | str = False,
        calibration_cap: float | None = None,
    ) -> None:
        super().__init__()
        # bounded: numpy's multinomial draws take a C long, and a billion draws per round is beyond any run
        self.K = check_int(K, "K (number of draws per round)", 1, MAX_DRAWS)
        self.unavailable = check_choice(unavailable, "unavailable", UNAVAILABLE)
        self.server_lr = check_real(server_lr, "server_lr", 0.0, math.inf, low_open=True)
        self.estimator_name = check_choice(estimator, "estimator", ESTIMATORS)
        # numbers first, so that the combined check below compares floats
        self.momentum = check_real(momentum, "momentum", 0.0, 1.0, high_open=True)
        self.prox_mu = check_real(prox_mu, "prox_mu", 0.0)
        self.local_lr = None if local_lr is None else check_real(local_lr, "local_lr", 0.0, low_open=True)
        check_local_solver(self.momentum, self.prox_mu, self.local_lr)
        self.min_success = check_real(min_success, "min_success", 0.0, 1.0, low_open=True)
        self.ema = check_real(ema, "ema (the estimator's rate)", 0.0, 1.0, low_open=True)
        self.estimator = SystemEstimator(self.ema) if estimator == "ema" else None
        self._prox = self.prox_mu * self.local_lr if self.prox_mu > 0 else 0.0
        self.last_probabilities: Tensor | None = None
        self.last_counts: Tensor | None = None
        self.last_system: dict[str, Tensor] | None = None
        self._counts_round: int | None = None
        self._known: dict[str, Tensor | None] = {"success": None, "norms": None, "participation": None}
        self._observed_round: int | None = None
        self._warned = False
        self._acc: WeightedSum | None = None  # this round's (1/K) sum c_m f_m delta_m
        self._factors: Tensor | None = None
        self._step_scale = 1.0
        self._norm_cache: dict[int, float] = {}
        self.calibrate = _check_calibrate(calibrate, self.calibration_method)
        self.calibration_cap = None if calibration_cap is None else check_real(
            calibration_cap, "calibration_cap", 0.0, math.inf, low_open=True)
        #: App. I.2's multiplier of the open (or last) round, after the cap; 1.0 without calibration
        self.last_calibration = 1.0
        #: the largest weight applied to one update in the last closed round (server step included)
        self.last_max_weight = 0.0
        self._warned_weight = False

    def hparams(self) -> dict:
        out = {"K": self.K, "unavailable": self.unavailable, "server_lr": self.server_lr}
        if self.estimator_name is not None:
            out.update(estimator=self.estimator_name, ema=self.ema)
        if self.calibrate:
            out["calibrate"] = self.calibrate
            if self.calibration_cap is not None:
                out["calibration_cap"] = self.calibration_cap
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

    # ------------------------------------------------------------------ local solver
    def _uses_norms(self) -> bool:
        """Whether this rule's numbers depend on the clients' ``||a||_1`` (FedACS: always; c-a-FedAvg: to calibrate)."""
        return False

    def check_client_solver(self, optimizer: torch.optim.Optimizer, optimizer_state: str) -> None:
        """Refuse a client optimizer whose ``||a||_1`` is not the one this rule computes from ``momentum``,
        ``prox_mu`` and ``local_lr`` (:func:`~lightning_fedhet.algorithms.fednova.check_optimizer_matches`), when
        the rule uses ``||a||_1`` at all; any optimizer is accepted otherwise."""
        if self._uses_norms():
            check_optimizer_matches(type(self).__name__, optimizer, optimizer_state, self.momentum, self.prox_mu,
                                    self.local_lr)

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
                    "known success probabilities and local steps (Algorithm 1 line 4 needs this round's values)",
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

    @property
    def scales_client_lr(self) -> bool:
        return self.calibrate == "client"

    def _calibration(self, system: dict[str, Tensor]) -> float:
        """App. I.2's multiplier for this round's ``s`` and ``||a||_1`` (capped at ``calibration_cap``); 1.0 when
        ``calibrate`` is off."""
        if not self.calibrate:
            return 1.0
        omega = self._calibration_weights()
        factor = lr_scalings(omega, system["success"], system["norms"])[self.calibration_method].client
        return factor if self.calibration_cap is None else min(factor, self.calibration_cap)

    def _calibration_weights(self) -> Tensor:
        """The target weights ``omega`` App. I.2 anchors at (FedACS: its ``omega``)."""
        return self.client_weights

    def _round_step_scale(self, system: dict[str, Tensor]) -> float:
        """The server-step multiplier of this round (``calibrate="server"``: the calibration; else 1)."""
        return self.last_calibration if self.calibrate == "server" else 1.0

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
            if ctx.availability_probs is not None and self._known["participation"] is None:
                # pi_m is the availability (the probability of being aggregated would count the links twice)
                self._known["participation"] = check_vector(ctx.availability_probs, "availability_probs", 0.0, 1.0,
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
        self.last_calibration = self._calibration(self.last_system)
        # the paper's reading: eta itself, i.e. the local step of every client of this round (the engines apply it)
        self.client_lr_scale = self.last_calibration if self.calibrate == "client" else 1.0
        self._step_scale = self._round_step_scale(self.last_system)
        self._acc = WeightedSum(self.params)

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._acc, self._acc)
        count = int(self.last_counts[client])
        if count == 0:
            raise ValueError(f"client {client} was not drawn by select() in round {self._counts_round}")
        # rule (3): an update drawn c_m times counts c_m times, whatever arrives the divisor is K
        self._acc.add(client, delta, weight=count * float(self._factors[client]) / self.K)
        self._after_add(client, delta)

    def _after_add(self, client: int, delta: Tensor) -> None:
        pass

    def round_shares(self) -> RoundShares:
        return self._acc.shares()

    def close_round(self) -> Tensor:
        acc = self._acc
        if acc is None:
            raise RuntimeError("close_round() called without open_round()")
        if len(acc):
            self.params = self.params + (self.server_lr * self._step_scale) * acc.total
        self.last_weights = acc.scaled_weights(self._step_scale)
        self._check_extrapolation()
        if self.estimator is not None:
            arrived = torch.zeros(self.num_clients, dtype=torch.bool)
            if len(acc):
                arrived[list(acc.weights)] = True
            ctx = self.ctx
            norms = None
            if ctx is not None and ctx.local_steps is not None:
                steps = torch.as_tensor(ctx.local_steps).flatten().cpu().to(torch.int64)
                norms = torch.full((self.num_clients,), float("nan"), dtype=_F64)
                if (steps > 0).any():
                    norms[steps > 0] = self.norms_from_steps(steps[steps > 0])
            available = None if ctx is None else torch.as_tensor(ctx.available).flatten().cpu() != 0
            drawn = self.last_counts > 0
            if self.client_sizes is not None:
                # a client holding no data never trains, so its draws say nothing about its link: counting them as
                # failures would drive its s_hat to 0 and its p_m ∝ 1/s_hat to 1, and every draw would go to it
                drawn = drawn & (self.client_sizes > 0)
            self.estimator.update(drawn, arrived, available, norms)
        self._acc = None
        return self.params

    def _check_extrapolation(self) -> None:
        """Record the largest applied weight and warn (once) when a server-step multiplier above 1 pushed it past 1:
        the server then moves beyond that client's own model, which an average never does (the FedACS study's
        collapse under server-step calibration, where c = 2.4-10.5 put weights up to 4 on single updates).
        c-a-FedAvg's ``1/s_m`` alone may exceed 1 by design (an unbiased estimate) and does not warn."""
        weights = {c: self.server_lr * w for c, w in self.last_weights.items()}
        self.last_max_weight = max(weights.values(), default=0.0)
        amplified = self.server_lr * self._step_scale > 1.0
        if amplified and self.last_max_weight > 1.0 and not self._warned_weight:
            client = max(weights, key=weights.get)
            if self.calibrate == "server":
                cause = f"calibrate='server' multiplied the step by {self.last_calibration:.3g}"
            else:
                cause = f"server_lr={self.server_lr:g}, step multiplier {self._step_scale:.3g}"
            warnings.warn(
                f"{type(self).__name__}: round {self._counts_round} applied weight {self.last_max_weight:.3g} > 1 to "
                f"client {client}'s update ({cause}): the server extrapolates past that client's model; with "
                "calibration, prefer calibrate='client' (the paper's eta) or a calibration_cap",
                stacklevel=3,
            )
            self._warned_weight = True

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
            "calibration": self.last_calibration,
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
        self.last_calibration = float(s.get("calibration", 1.0))  # older checkpoints: no calibration recorded
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
