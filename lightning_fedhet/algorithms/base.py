"""The server-rule protocol shared by every aggregation algorithm (DESIGN.md §2.3).

Algorithms are framework-free: they see flat parameter vectors (``torch.Tensor`` of shape ``[d]``)
and per-client metadata, never a LightningModule. A round is streamed, so the server never holds
all of a cohort's updates at once::

    algo.setup(num_clients=N, init_params=w0, client_weights=alpha)
    for t in range(T):
        selected = algo.select(t, available, rng)          # bool[N] (or counts[N])
        algo.open_round(t, RoundContext(...))
        for i in arrived:
            algo.add(i, delta_i, ClientInfo(num_samples=n_i, local_steps=K_i, loss=l_i))
        w = algo.close_round()                             # new global parameters, shape [d]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class RoundContext:
    """What the server can know about round ``round`` before it aggregates.

    All masks are tensors of shape ``[num_clients]``.

    Attributes:
        round: 0-based round index ``t``.
        num_clients: ``N``.
        available: bool, clients the participation process made available.
        selected: bool, clients the server asked to train (subset of ``available``).
        received: bool, clients whose update reached the server this round.
        participation_probs: float, the true probability that each client is selected in a round, from the
            participation process (``None`` when it has no closed form). Rules that must not know it ignore it.
        success_probs: float, probability that a client's round trip succeeds (``None`` if unknown).
        local_steps: int, local steps each client was asked to run this round (0 if not selected).
    """

    round: int
    num_clients: int
    available: Tensor
    selected: Tensor
    received: Tensor
    participation_probs: Tensor | None = None
    success_probs: Tensor | None = None
    local_steps: Tensor | None = None


@dataclass
class ClientInfo:
    """Metadata that travels with one client's update.

    Attributes:
        num_samples: number of training samples the client holds, ``|D_i|``.
        local_steps: local optimizer steps the client actually ran this round.
        loss: mean training loss over the client's local steps (``nan`` if not reported).
    """

    num_samples: int
    local_steps: int
    loss: float = float("nan")


class Algorithm:
    """Base class of a server rule. Subclasses override :meth:`add` and :meth:`close_round`.

    The base class keeps the global parameters (``self.params``, shape ``[d]``, fp32 on CPU unless
    ``setup`` received another dtype/device), the relative client weights ``self.client_weights``
    (``alpha_i``, shape ``[N]``, summing to 1) and the round bookkeeping. ``self.last_weights``
    maps client id -> weight applied to its fresh update in the last closed round; the strategy
    copies it into ``history``.
    """

    def __init__(self) -> None:
        self.num_clients: int = 0
        self.params: Tensor | None = None
        self.client_weights: Tensor | None = None
        self.ctx: RoundContext | None = None
        self.last_weights: dict[int, float] = {}
        # |D_i| of every client (int64 [N]), set by the strategy after setup(); rules that weigh by data
        # held by *other* clients (FedCIS's |D_{e,p}|) read it. None when unknown.
        self.client_sizes: Tensor | None = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, num_clients: int, init_params: Tensor, client_weights: Tensor | None = None) -> None:
        """Initialise server state.

        Args:
            num_clients: ``N >= 1``.
            init_params: initial global parameters ``w_0``, shape ``[d]``.
            client_weights: ``alpha_i`` (e.g. ``|D_i|``), shape ``[N]``, non-negative; normalised to
                sum to 1. ``None`` means uniform ``1/N``.
        """
        if int(num_clients) < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        if init_params.dim() != 1:
            raise ValueError(f"init_params must be a flat vector of shape [d], got shape {tuple(init_params.shape)}")
        self.num_clients = int(num_clients)
        self.params = init_params.detach().clone()
        if client_weights is None:
            client_weights = torch.full((self.num_clients,), 1.0 / self.num_clients, dtype=torch.float64)
        client_weights = torch.as_tensor(client_weights, dtype=torch.float64).flatten()
        if client_weights.numel() != self.num_clients:
            raise ValueError(
                f"client_weights must have num_clients={self.num_clients} entries, got {client_weights.numel()}"
            )
        if (client_weights < 0).any() or not torch.isfinite(client_weights).all() or client_weights.sum() <= 0:
            raise ValueError("client_weights must be finite, non-negative and not all zero")
        self.client_weights = client_weights / client_weights.sum()

    def select(self, round: int, available: Tensor, rng: np.random.Generator) -> Tensor:
        """Which available clients the server asks to train. Default: all available.

        Args:
            round: 0-based round index.
            available: bool tensor ``[N]``.
            rng: generator seeded from (seed, round) by the caller.

        Returns:
            bool tensor ``[N]`` (or int counts ``[N]`` for samplers with replacement).
        """
        return available.clone()

    def client_config(self, client: int) -> dict:
        """Instructions for ``client``'s local training this round, called after :meth:`select`.

        The strategy passes a non-empty dict to the LightningModule's ``configure_client(**config)``
        before the client's first local step (FedCIS sends ``{"train_exit": e}``). Default: ``{}``.
        """
        return {}

    def open_round(self, round: int, ctx: RoundContext) -> None:
        """Start aggregating round ``round``; ``ctx`` holds what the server may know."""
        self._check_ready()
        self.ctx = ctx
        self.last_weights = {}

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        """Absorb one arrived update ``delta = w_i - w_t`` (shape ``[d]``) of ``client``."""
        raise NotImplementedError

    def close_round(self) -> Tensor:
        """Finish the round and return the new global parameters ``w_{t+1}`` (shape ``[d]``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to resume exactly (global params included)."""
        return {
            "num_clients": self.num_clients,
            "params": None if self.params is None else self.params.clone(),
            "client_weights": None if self.client_weights is None else self.client_weights.clone(),
            "client_sizes": None if self.client_sizes is None else self.client_sizes.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.num_clients = int(state["num_clients"])
        self.params = None if state["params"] is None else state["params"].clone()
        self.client_weights = None if state["client_weights"] is None else state["client_weights"].clone()
        sizes = state.get("client_sizes")
        self.client_sizes = None if sizes is None else sizes.clone()

    # ------------------------------------------------------------------ helpers
    def _check_ready(self) -> None:
        if self.params is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called before the first round")

    def _check_update(self, client: int, delta: Tensor, accumulator: object, seen) -> None:
        """The checks every :meth:`add` starts with: the round is open (``accumulator`` is set), the client id
        and the delta's shape are valid, and ``client`` is not already in ``seen`` this round."""
        if accumulator is None:
            raise RuntimeError("add() called without open_round()")
        self._check_client(client, delta)
        if client in seen:
            raise ValueError(f"client {client} already added in this round")

    def _check_client(self, client: int, delta: Tensor) -> None:
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client id {client} out of range [0, {self.num_clients})")
        if delta.shape != self.params.shape:
            raise ValueError(
                f"delta of client {client} has shape {tuple(delta.shape)}, expected {tuple(self.params.shape)}"
            )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({fields})"

    def hparams(self) -> dict:
        """Constructor arguments, for logging."""
        return {}
