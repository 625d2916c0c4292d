"""F3AST as run in CA-Fed's experiments (Ribero et al. 2023; thesis ch. 2 §2.5 "Benchmarks"): the top ``k`` available
clients by ``alpha_i^2 / r_i^2``, weighted ``alpha_i / r_i`` (see :mod:`~.cafed`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice, check_int, check_length, check_real, check_vector
from lightning_fedhet.algorithms._availability import AvailabilityRule
from lightning_fedhet.algorithms.base import RoundContext

_F64 = torch.float64
F3AST_RATES = ("ema", "code", "exact")


def _clone(x):
    return None if x is None else x.clone()


class F3AST(AvailabilityRule):
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
