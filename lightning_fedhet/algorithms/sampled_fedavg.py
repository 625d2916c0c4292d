"""SampledFedAvg: the FedACS paper's FedAvg baseline, importance sampling ``p = omega`` with ``K`` draws with
replacement and divisor ``K`` (see :mod:`~lightning_fedhet.algorithms.fedacs` for the shared model)."""

from __future__ import annotations

from torch import Tensor

from lightning_fedhet._checks import check_distribution, check_length
from lightning_fedhet.algorithms._sampler import WithReplacementSampler


class SampledFedAvg(WithReplacementSampler):
    """FedAvg with importance sampling (the FedACS paper's FedAvg, Example 2): ``K`` draws from ``p = omega``, ÷K.

    Args:
        K: draws per round (integer ``>= 1``).
        probabilities: fixed sampling probabilities (must sum to 1); default ``omega`` = the ``client_weights`` of
            :meth:`setup`. With ``p != omega`` this is the generic anonymous rule (3) whose surrogate is
            ``Omega ∝ p s ||a||_1``.
        unavailable: ``"renormalize"`` or ``"drop"`` (module doc).
        server_lr: ``> 0``.

    Example::

        >>> import numpy as np
        >>> import torch
        >>> from lightning_fedhet.algorithms import ClientInfo
        >>> algo = SampledFedAvg(K=2, probabilities=[1.0, 0.0])
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.select(0, torch.tensor([True, True]), np.random.default_rng(0))
        tensor([2, 0])
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([3.0]), ClientInfo(num_samples=1, local_steps=1))
        >>> algo.close_round()          # drawn twice: 2/K * 3
        tensor([3.])
    """

    def __init__(self, K: int, probabilities=None, unavailable: str = "renormalize", server_lr: float = 1.0) -> None:
        super().__init__(K, unavailable, server_lr)
        self._probs_given = None if probabilities is None else check_distribution(probabilities, "probabilities")

    def hparams(self) -> dict:
        out = super().hparams()
        if self._probs_given is not None:
            out["probabilities"] = self._probs_given.tolist()
        return out

    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        if self._probs_given is not None:
            check_length(self._probs_given.numel(), self.num_clients, "probabilities")

    def _scores(self, system: dict[str, Tensor]) -> Tensor:
        return (self.client_weights if self._probs_given is None else self._probs_given).clone()
