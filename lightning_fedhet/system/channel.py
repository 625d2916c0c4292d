"""Lossy links between the server and the clients (thesis ch.4 §4.2; FedACS §1.4)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import as_numpy_mask, as_prob_array, check_int, check_round, check_seed, per_client
from lightning_fedhet.seeding import Stream, generator


class LossyChannel:
    """Independent packet losses on the downlink (global model) and uplink (client update).

    ``q`` is a **loss** probability (FedACS's ``q_m``, the thesis's ``q_si`` / ``q_is``): a transmission to or from
    client ``i`` is lost with probability ``q_i``, independently across clients and rounds (thesis Assumption 14)
    and independently of availability and selection. A client that misses the downlink does not train; the
    overall success probability is ``(1 - q_down)(1 - q_up)`` (:attr:`success_probs`).

    Round ``t`` draws ``U ~ Uniform[0, 1)^N`` from ``generator(seed, Stream.DOWNLINK, t)`` (resp. ``UPLINK``) for
    all ``N`` clients and keeps client ``i`` iff it was in the input mask and ``U_i >= q_i``; so outcomes are pure
    functions of ``(seed, t)`` and do not depend on which other clients were selected.

    Args:
        uplink: uplink loss probability ``q_up`` in ``[0, 1)``: a scalar, a per-client sequence, or a per-round
            draw such as :class:`UniformLoss` (FedACS's dynamic setting, where ``q_m^{(r)}`` changes every round).
        downlink: downlink loss probability ``q_down``, same forms.

    Usage::

        channel = LossyChannel(uplink=0.1, downlink=[0.0, 0.5])
        channel.setup(num_clients=2, seed=0)
        got_model = channel.downlink(t, selected)     # torch.bool [N]
        arrived = channel.uplink(t, got_model)         # torch.bool [N]
    """

    def __init__(self, uplink: Any = 0.0, downlink: Any = 0.0) -> None:
        self._q_up_spec = (
            uplink if isinstance(uplink, LossDistribution) else as_prob_array(uplink, "uplink", high_open=True)
        )
        self._q_down_spec = (
            downlink if isinstance(downlink, LossDistribution) else as_prob_array(downlink, "downlink", high_open=True)
        )
        self.num_clients = 0
        self.seed = 0
        self.q_up = self.q_down = np.empty(0)

    def setup(self, num_clients: int, seed: int = 0) -> None:
        # checked and resolved before anything is assigned: a refused setup leaves the channel as it was
        num_clients, seed = check_int(num_clients, "num_clients"), check_seed(seed)
        q_up = self._resolve(self._q_up_spec, 0, "uplink", num_clients, seed)
        q_down = self._resolve(self._q_down_spec, 0, "downlink", num_clients, seed)
        self.num_clients, self.seed, self.q_up, self.q_down = num_clients, seed, q_up, q_down

    @property
    def dynamic(self) -> bool:
        """Whether the loss probabilities are re-drawn every round."""
        return isinstance(self._q_up_spec, LossDistribution) or isinstance(self._q_down_spec, LossDistribution)

    @staticmethod
    def _resolve(spec: Any, round: int, name: str, num_clients: int, seed: int) -> np.ndarray:
        if isinstance(spec, LossDistribution):
            return spec.sample(round, num_clients, seed)
        return per_client(spec, num_clients, name)

    def _at(self, spec: Any, round: int, name: str) -> np.ndarray:
        return self._resolve(spec, round, name, self.num_clients, self.seed)

    def loss_probs_at(self, round: int) -> tuple[np.ndarray, np.ndarray]:
        """``(q_up, q_down)`` of round ``round``, float64 ``[N]`` each."""
        self._check_setup()
        return self._at(self._q_up_spec, round, "uplink"), self._at(self._q_down_spec, round, "downlink")

    def success_probs_at(self, round: int) -> Tensor:
        """``(1 - q_down)(1 - q_up)`` per client in round ``round`` (what the server's system oracle sees)."""
        q_up, q_down = self.loss_probs_at(round)
        return torch.as_tensor((1.0 - q_down) * (1.0 - q_up), dtype=torch.float64)

    def _check_setup(self) -> None:
        if self.num_clients < 1:
            raise RuntimeError("LossyChannel.setup(num_clients, seed) must be called first")

    def _transmit(self, stream: Stream, round: int, mask: Any, q: np.ndarray, name: str) -> Tensor:
        self._check_setup()
        check_round(round)
        sent = as_numpy_mask(mask, self.num_clients, name)
        ok = generator(self.seed, stream, int(round)).random(self.num_clients) >= q
        return torch.from_numpy(sent & ok)

    def downlink(self, round: int, selected: Any) -> Tensor:
        """Clients of ``selected`` (bool ``[N]``) that received the global model in round ``round``."""
        q_down = self._at(self._q_down_spec, round, "downlink") if self.dynamic else self.q_down
        return self._transmit(Stream.DOWNLINK, round, selected, q_down, "selected")

    def uplink(self, round: int, trained: Any) -> Tensor:
        """Clients of ``trained`` (bool ``[N]``) whose update reached the server in round ``round``."""
        q_up = self._at(self._q_up_spec, round, "uplink") if self.dynamic else self.q_up
        return self._transmit(Stream.UPLINK, round, trained, q_up, "trained")

    @property
    def success_probs(self) -> Tensor:
        """``(1 - q_down)(1 - q_up)`` per client: probability that a selected client's update arrives.

        For a channel whose loss probabilities change every round this is round 0's; use
        :meth:`success_probs_at`.
        """
        self._check_setup()
        return torch.as_tensor((1.0 - self.q_down) * (1.0 - self.q_up), dtype=torch.float64)

    @property
    def uplink_success(self) -> Tensor:
        """``1 - q_up`` per client: probability that a trained client's update arrives."""
        self._check_setup()
        return torch.as_tensor(1.0 - self.q_up, dtype=torch.float64)

    @property
    def downlink_success(self) -> Tensor:
        """``1 - q_down`` per client: probability that a selected client receives the global model."""
        self._check_setup()
        return torch.as_tensor(1.0 - self.q_down, dtype=torch.float64)

    def __repr__(self) -> str:
        def fmt(arr) -> str:
            if isinstance(arr, LossDistribution):
                return repr(arr)
            return f"{float(arr):g}" if arr.ndim == 0 else f"<{arr.shape[0]} per-client values>"

        return f"LossyChannel(uplink={fmt(self._q_up_spec)}, downlink={fmt(self._q_down_spec)})"


class LossDistribution:
    """Per-round loss probabilities: ``sample(round, num_clients, seed) -> float64 [N]`` in ``[0, 1)``."""

    def sample(self, round: int, num_clients: int, seed: int) -> np.ndarray:
        raise NotImplementedError


class UniformLoss(LossDistribution):
    """``q_i^{(t)} ~ U[low_i, high_i)`` independently per client and round (FedACS's dynamic links).

    Args:
        low, high: bounds in ``[0, 1)``, scalars or per-client sequences, ``low <= high``.
    """

    def __init__(self, low: Any, high: Any) -> None:
        self.low = as_prob_array(low, "low", high_open=True)
        self.high = as_prob_array(high, "high", high_open=True)
        if self.low.ndim == self.high.ndim == 1 and self.low.shape != self.high.shape:
            raise ValueError(f"low and high have different lengths ({self.low.shape[0]} and {self.high.shape[0]})")
        if np.any(self.low > self.high):
            raise ValueError(f"low must be <= high, got low={low}, high={high}")

    def sample(self, round: int, num_clients: int, seed: int) -> np.ndarray:
        num_clients = check_int(num_clients, "num_clients")
        low = per_client(self.low, num_clients, "low")
        high = per_client(self.high, num_clients, "high")
        return generator(check_seed(seed), Stream.LOSS_RATES, check_round(round)).uniform(low, high)

    def __repr__(self) -> str:
        return f"UniformLoss(low={self.low!r}, high={self.high!r})"
