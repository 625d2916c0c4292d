"""The plumbing shared by CA-Fed and the baselines of its experiments (:mod:`~lightning_fedhet.algorithms.cafed`,
:mod:`~.adafed`, :mod:`~.f3ast`): observe every client's availability once per round, choose who trains, and take
the server step ``w + server_lr * sum_{i received} q_i delta_i`` (thesis eq. 2.3, no projection).
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from lightning_fedhet._checks import check_mask, check_real
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares


def _clone(x):
    return None if x is None else x.clone()


class AvailabilityRule(Algorithm):
    """Observes availability once per round (in select or open_round); aggregates ``sum q_i delta_i``.

    Subclasses implement :meth:`_on_round` (update the estimates with round ``t``'s availability and decide),
    :meth:`_choose` (who trains among the available clients) and :meth:`_round_weights` (``q``, float64 ``[N]``);
    :meth:`_on_add` / :meth:`_on_close` see every arrived update and the end of the round.
    """

    selects_clients = True
    shares_rounds = True

    def __init__(self, server_lr: float = 1.0) -> None:
        super().__init__()
        self.server_lr = check_real(server_lr, "server_lr", 0.0, low_open=True)
        self._observed_round: int | None = None
        self.last_available: Tensor | None = None
        self._weights: Tensor | None = None
        self._acc: WeightedSum | None = None  # this round's sum_i q_i delta_i

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
        self._acc = WeightedSum(self.params)

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._acc, self._acc)
        self._acc.add(client, delta, weight=float(self._weights[client]))
        self._on_add(client, info)

    def _on_add(self, client: int, info: ClientInfo) -> None:
        pass

    def round_shares(self) -> RoundShares:
        return self._acc.shares()

    def close_round(self) -> Tensor:
        acc = self._acc
        if acc is None:
            raise RuntimeError("close_round() called without open_round()")
        # eq. 2.3 without renormalisation; a round where no update with q_i > 0 arrived leaves w unchanged
        if any(w != 0.0 for w in acc.weights.values()):
            self.params = self.params + self.server_lr * acc.total
        self.last_weights = dict(acc.weights)
        self._on_close()
        self._acc = None
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
