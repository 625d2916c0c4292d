"""MIFA (Gu et al. 2021), as run by the FedAU paper's code (its ``mifa`` aggregation; the FedStale paper §2 names it
as the SAG-style, uniformly weighted alternative)::

    y_i <- delta_i  for i in R_t          (refresh the memory first)
    w_{t+1} = w_t + server_lr * sum_{j=1..N} alpha_j y_j

i.e. the (``alpha``-weighted; ``1/N`` by default) average of every client's latest update, fresh or stale. A
client that has never arrived contributes 0 (``y_i = 0`` initially). Fresh and stale updates are weighted
uniformly (no ``1/p_i``), which is why the FedStale paper calls it biased. This is Eq. 7 of FedStale with every
``p_i = 1``.

**Empty rounds.** MIFA's update is defined by the memory alone, so by default (``empty_round="stale"``, the FedAU
code's behaviour) a round where nobody arrives still applies ``sum_j alpha_j y_j``; ``empty_round="skip"`` leaves
``w`` unchanged instead.

Memory: ``N * d * element_size`` bytes at ``memory_dtype`` on ``memory_device`` (default fp32, CPU), allocated at
:meth:`setup`, reported by ``memory_bytes``; the aggregate is read from the running total kept by
:class:`~lightning_fedhet.algorithms.fedstale.StaleMemory`, so a round costs ``O(|R_t| d)``. Note that, unlike
FedVARP/FedStale, MIFA applies fresh updates as stored, i.e. rounded to ``memory_dtype``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice, check_real
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares
from lightning_fedhet.algorithms.fedstale import EMPTY_ROUNDS, StaleMemory


class MIFA(Algorithm):
    """Average of the latest update of every client (memory refreshed before averaging).

    Args:
        memory_dtype, memory_device: storage of the ``N x d`` memory.
        server_lr: ``eta_s > 0``.
        empty_round: ``"stale"`` (default; apply the memory average) or ``"skip"``.

    Example::

        >>> algo = MIFA()
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([4.0]), ClientInfo(1, 1))
        >>> algo.close_round()       # (4 + 0) / 2
        tensor([2.])
        >>> algo.open_round(1, None)
        >>> algo.close_round()       # nobody arrived: (4 + 0) / 2 again
        tensor([4.])
    """

    shares_rounds = True

    def __init__(
        self,
        memory_dtype: torch.dtype = torch.float32,
        memory_device: str | torch.device = "cpu",
        server_lr: float = 1.0,
        empty_round: str = "stale",
    ) -> None:
        super().__init__()
        server_lr = check_real(server_lr, "server_lr", 0.0, math.inf, low_open=True, high_open=True)
        check_choice(empty_round, "empty_round", EMPTY_ROUNDS)
        self.server_lr = float(server_lr)
        self.empty_round = empty_round
        self.memory = StaleMemory(memory_dtype, memory_device)
        self._raw: dict[int, float] | None = None

    def hparams(self) -> dict:
        return {
            "memory_dtype": str(self.memory.dtype),
            "memory_device": str(self.memory.device),
            "server_lr": self.server_lr,
            "empty_round": self.empty_round,
        }

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the ``N x d`` memory (``N * d * element_size``)."""
        return self.memory.nbytes

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        self.memory.allocate(self.num_clients, self.params.numel(), self.client_weights, self.params.device)

    def shard_client_state(self, rank: int, world_size: int) -> bool:
        self.memory.shard(rank, world_size)
        return True

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        self._raw = {}

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._raw, self._raw)
        self._raw[client] = float(self.client_weights[client])
        self.memory.write(client, delta)

    def round_shares(self) -> RoundShares:
        return RoundShares(tables=[self._raw]).extend(self.memory.shares())

    def close_round(self) -> Tensor:
        if self._raw is None:
            raise RuntimeError("close_round() called without open_round()")
        self.memory.settle()  # the refreshed memory's total, every process's writes included
        self.last_weights = dict(self._raw)
        if self._raw or self.empty_round == "stale":
            self.params = self.params + (self.server_lr * self.memory.total).to(self.params)
        self._raw = None
        return self.params

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["memory"] = self.memory.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        device = self.params.device if self.params is not None else torch.device("cpu")
        self.memory.load_state_dict(state["memory"], self.client_weights, device)
