"""OS, optimal client sampling (Chen, Horváth, Richtárik; FedACS paper eq. (20)): ``p_m ∝ omega_m ||delta_m||``
from each client's last received update, aggregated unbiasedly with ``omega_m / p_m`` (see
:mod:`~lightning_fedhet.algorithms.fedacs`)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedhet._checks import check_real
from lightning_fedhet.algorithms._sampler import WithReplacementSampler
from lightning_fedhet.algorithms.base import RoundContext, RoundShares

_F64 = torch.float64


def _clone(x):
    return None if x is None else x.clone()


class OS(WithReplacementSampler):
    """Optimal client sampling (Chen, Horváth, Richtárik; FedACS paper eq. (20)).

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
