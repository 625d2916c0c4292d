"""The labelled EMA extension of the FedACS family (``estimator="ema"``): online estimates of what the server observes
(arrivals, local-solver norms, availability) instead of the paper's system oracle."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedhet._checks import check_real

_F64 = torch.float64


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
