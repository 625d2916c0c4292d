"""FedAU (Wang & Ji, "A Lightweight Method for Tackling Unknown Participation Statistics in Federated
Averaging", Algorithms 1-2).

The server update is Algorithm 1, line 13 of the paper, with the weights of Algorithm 2::

    w_{t+1} = w_t + server_lr * sum_{i in R_t} alpha_i * omega_t^i * delta_i

``alpha_i`` are the client weights given to :meth:`setup`; with the default uniform ``alpha_i = 1/N`` this is the
paper's ``(eta/N) sum_n omega_t^n delta_t^n``: the aggregate is divided by ``N`` (all clients), **not** by
``sum omega`` nor by the number of participants. Non-uniform ``alpha`` is the weighted objective
of the paper's App. A.1.

``omega_t^i`` is the online mean of client ``i``'s participation intervals, each cut off at ``K`` rounds
(Algorithm 2). It uses only the participation of rounds ``< t`` (Algorithm 1, line 12), starts at 1 and stays 1
until the first interval closes. Per client the state is three scalars ``(M_i, S_i^<>, omega_i)``, kept in
vectors of length ``N`` and updated for every client at every round (one vectorised step of Algorithm 2,
lines 4-11, in :meth:`close_round`), so no client is ever touched individually.

**What "participation" means here.** In the paper ``I_t^n = 1`` exactly when client ``n``'s update enters the
aggregate (Algorithm 1, lines 5-11: otherwise ``Delta_t^n = 0``). In this library the update of a selected
client can still be lost on the channel or rejected as non-finite, and such a client contributes nothing, like
a non-participant. So ``I_t^i = 1`` iff :meth:`add` was called for ``i`` in round ``t`` (a subset of
``RoundContext.received``; equal to it unless the strategy rejected an update). ``1/omega`` then estimates the
probability that a client's update is *absorbed*, which is what makes ``sum alpha_i omega_i delta_i`` unbiased.
The round context is therefore not needed (``open_round`` accepts ``ctx=None``).

:class:`IntervalEstimator` is Algorithm 2 on its own; :meth:`FedAU.participation_estimates` (and
``IntervalEstimator.estimates``) returns ``p_hat_i = 1 / omega_i``, which :class:`~lightning_fedhet.algorithms.
fedstale.FedStale` and :class:`~lightning_fedhet.algorithms.fedvarp.FedVARP` can use in place of the true
``p_i`` (``p_source="fedau"``), as in the FedStale paper §5.3.

An empty round (nobody arrives) leaves ``w`` unchanged (as in the paper's code) but still advances every client's
interval.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from lightning_fedhet._checks import check_real
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares

#: The interval counters are int64 tensors: a larger cut-off could not be compared with them (use None instead).
MAX_CUTOFF = 2**63 - 1


def _check_cutoff(K) -> int | None:
    if K is None:
        return None
    if isinstance(K, bool) or not isinstance(K, numbers.Integral) or not 1 <= int(K) <= MAX_CUTOFF:
        raise ValueError(f"K (FedAU cut-off interval) must be an integer in [1, 2**63 - 1], or None for no cut-off; "
                         f"got {K!r}")
    return int(K)


class IntervalEstimator:
    """FedAU's Algorithm 2: online mean of cut-off participation intervals, vectorised over clients.

    Args:
        K: cut-off interval length (integer in ``[1, 2**63 - 1]``); ``None`` means no cut-off (``K -> infinity``).

    Call :meth:`setup` once, then :meth:`update` once per round with that round's participation mask. Before
    round ``t``'s update, :meth:`weights` holds ``omega_t`` (built from rounds ``< t`` only).

    Example::

        >>> est = IntervalEstimator(K=3)
        >>> est.setup(1)
        >>> for took_part in [False, False, True, False]:
        ...     est.update(torch.tensor([took_part]))
        >>> est.weights()    # one interval of length 3 closed (rounds 0-2) -> omega = 3
        tensor([3.], dtype=torch.float64)
    """

    def __init__(self, K: int | None = 50) -> None:
        self.K = _check_cutoff(K)
        self.num_clients = 0
        self.rounds = 0
        self.count: Tensor | None = None  # M_n, int64 [N]
        self.current: Tensor | None = None  # S_n^<>, int64 [N]
        self.omega: Tensor | None = None  # omega_{t-1}^n, float64 [N]

    def setup(self, num_clients: int) -> None:
        if int(num_clients) < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        n = self.num_clients = int(num_clients)
        self.rounds = 0
        self.count = torch.zeros(n, dtype=torch.int64)
        self.current = torch.zeros(n, dtype=torch.int64)
        self.omega = torch.ones(n, dtype=torch.float64)

    def _check_ready(self) -> None:
        if self.omega is None:
            raise RuntimeError("IntervalEstimator.setup(num_clients) must be called first")

    def update(self, participated: Tensor) -> None:
        """One step of Algorithm 2, lines 4-11, with ``I_{t-1} = participated`` (bool or counts, shape ``[N]``)."""
        self._check_ready()
        part = torch.as_tensor(participated).flatten().to("cpu")
        if part.numel() != self.num_clients:
            raise ValueError(f"participation mask must have num_clients={self.num_clients} entries, got {part.numel()}")
        part = part != 0
        self.current += 1  # line 4
        close = part if self.K is None else part | (self.current == self.K)  # line 5
        s = self.current.to(torch.float64)  # line 6
        m = self.count.to(torch.float64)
        new = torch.where(self.count == 0, s, (m * self.omega + s) / (m + 1))  # line 7
        self.omega = torch.where(close, new, self.omega)  # line 7 / line 11
        self.count += close.to(torch.int64)  # line 8
        self.current = torch.where(close, torch.zeros_like(self.current), self.current)  # line 9
        self.rounds += 1

    def weights(self) -> Tensor:
        """``omega_i`` for the next round, float64 ``[N]`` (1 until a client's first interval closes)."""
        self._check_ready()
        return self.omega.clone()

    def estimates(self) -> Tensor:
        """Estimated participation probabilities ``p_hat_i = 1/omega_i``, float64 ``[N]``, in ``[1/K, 1]``."""
        return 1.0 / self.weights()

    def state_dict(self) -> dict:
        return {
            "K": self.K,
            "num_clients": self.num_clients,
            "rounds": self.rounds,
            "count": None if self.count is None else self.count.clone(),
            "current": None if self.current is None else self.current.clone(),
            "omega": None if self.omega is None else self.omega.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["K"] != self.K:
            raise ValueError(f"state was saved with K={state['K']!r} but this estimator has K={self.K!r}")
        self.num_clients = int(state["num_clients"])
        self.rounds = int(state["rounds"])
        for key in ("count", "current", "omega"):
            setattr(self, key, None if state[key] is None else state[key].clone())

    def __repr__(self) -> str:
        return f"IntervalEstimator(K={self.K!r})"


class FedAU(Algorithm):
    """FedAvg with FedAU's adaptive weights ``omega_i`` (online cut-off participation-interval means).

    Args:
        K: cut-off interval length, integer in ``[1, 2**63 - 1]`` (paper's best: 50); ``None`` for no cut-off.
        server_lr: global step size ``eta > 0``.

    Extra state: three scalars per client (``O(N)`` in total, no model-sized buffer).

    Example::

        >>> algo = FedAU(K=50)
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([4.0]), ClientInfo(num_samples=1, local_steps=1))
        >>> algo.close_round()          # omega = 1 in round 0; divided by N = 2
        tensor([2.])
    """

    shares_rounds = True

    def __init__(self, K: int | None = 50, server_lr: float = 1.0) -> None:
        super().__init__()
        server_lr = check_real(server_lr, "server_lr", 0.0, math.inf, low_open=True, high_open=True)
        self.estimator = IntervalEstimator(K)
        self.K = self.estimator.K
        self.server_lr = float(server_lr)
        self._sum: WeightedSum | None = None
        self._omega: Tensor | None = None

    def hparams(self) -> dict:
        return {"K": self.K, "server_lr": self.server_lr}

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        self.estimator.setup(self.num_clients)

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        self._omega = self.estimator.weights()
        self._sum = WeightedSum(self.params)

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._sum)
        self._sum.add(client, delta, float(self.client_weights[client]) * float(self._omega[client]))

    def round_shares(self) -> RoundShares:
        return self._sum.shares()

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        if len(self._sum) > 0:
            self.params = self.params + self.server_lr * self._sum.total
        mask = torch.zeros(self.num_clients, dtype=torch.bool)
        if len(self._sum) > 0:
            mask[list(self._sum)] = True
        self.estimator.update(mask)
        self.last_weights = dict(self._sum.weights)
        self._sum = None
        return self.params

    def aggregation_weights(self) -> Tensor:
        """``omega_i`` that the next round will apply (before the ``alpha_i`` factor), float64 ``[N]``."""
        return self.estimator.weights()

    def participation_estimates(self) -> Tensor:
        """``p_hat_i = 1/omega_i`` for the next round, float64 ``[N]``."""
        return self.estimator.estimates()

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["fedau"] = self.estimator.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.estimator.load_state_dict(state["fedau"])
