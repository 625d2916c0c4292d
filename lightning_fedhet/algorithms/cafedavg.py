"""c-a-FedAvg ("communication-aware FedAvg", Perazzone et al.; FedACS paper eq. (113)): importance sampling and
each arrived update divided by its success probability (see :mod:`~lightning_fedhet.algorithms.fedacs`)."""

from __future__ import annotations

from torch import Tensor

from lightning_fedhet.algorithms._sampler import WithReplacementSampler
from lightning_fedhet.algorithms.base import RoundContext


class CAFedAvg(WithReplacementSampler):
    """c-a-FedAvg ("communication-aware FedAvg", Perazzone et al.; FedACS paper eq. (113)).

    Importance sampling ``p = omega`` (``K`` draws with replacement) and each received update divided by its
    success probability: ``w + (1/K) sum_{received} c_m delta_m / s_m``. Removes the communication bias only
    (``Omega ∝ omega ||a||_1`` remains). ``s_m`` is ``RoundContext.success_probs`` of the round (the paper's known
    ``q``), else the last value from :meth:`observe_system`, else 1; with ``estimator="ema"`` the EMA estimate
    (extension). Under ``unavailable="drop"`` the divisor is ``pi_m s_m``.

    Args:
        K: draws per round (integer ``>= 1``).
        unavailable: ``"renormalize"`` or ``"drop"``.
        calibrate: App. I.2's multiplier ``sum omega s a / sum omega a <= 1`` each round (needs ``||a||`` from
            :meth:`observe_system` or the context): ``True``/``"client"`` scales the clients' learning rate (the
            paper's ``eta``), ``"server"`` the server step (first-order equivalent while ``eta ||a||_1`` is small).
        momentum, prox_mu, local_lr: local solver (for ``||a||_1`` in the calibration only).
        estimator, ema: as in :class:`FedACS`.
        server_lr: ``> 0``.
        calibration_cap: upper bound on the calibration multiplier (``None``: uncapped).
    """

    calibration_method = "cafedavg"

    def __init__(
        self,
        K: int,
        unavailable: str = "renormalize",
        calibrate: bool | str = False,
        momentum: float = 0.0,
        prox_mu: float = 0.0,
        local_lr: float | None = None,
        estimator: str | None = None,
        ema: float = 0.1,
        server_lr: float = 1.0,
        min_success: float = 1e-6,
        calibration_cap: float | None = None,
    ) -> None:
        super().__init__(K, unavailable, server_lr, estimator, ema, momentum, prox_mu, local_lr, min_success,
                         calibrate, calibration_cap)

    def _uses_norms(self) -> bool:
        return self.calibrate  # ||a||_1 enters only App. I.2's step multiplier

    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        return self.client_weights.clone()

    def _round_factors(self, probs: Tensor, system: dict[str, Tensor], ctx: RoundContext | None) -> Tensor:
        s = system["success"]
        if self.estimator is None and ctx is not None and ctx.success_probs is not None:
            s = self._known["success"].clamp(min=self.min_success)  # just refreshed from ctx in open_round
            if self.unavailable == "drop" and self._known["participation"] is not None:
                s = (s * self._known["participation"]).clamp(min=self.min_success)
        return 1.0 / s

