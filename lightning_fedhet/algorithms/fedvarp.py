"""FedVARP (Jhunjhunwala et al. 2022), in the unbiased form of the FedStale paper (Eq. 7; thesis Eq. 3.7) and the
form of the FedAU paper's code (its ``fedvarp`` aggregation)::

    w_{t+1} = w_t + server_lr * [ sum_{j=1..N} alpha_j y_j  +  sum_{i in R_t} c_i (delta_i - y_i) ]
    y_i <- delta_i  for i in R_t    (after the update: the bracket uses the memory *before* replacement)

``c_i = alpha_i / sum_{j in R_t} alpha_j`` for ``weighting="participating"`` (default; ``1/|R_t|`` with uniform
``alpha``, FedAU paper's code) or ``c_i = alpha_i / p_i`` for ``weighting="known_p"`` (``1/(N p_i)``, FedStale
paper's "U-FedVARP"). Stale updates ``y_i`` (initially 0) stand in for absent clients; memory cost
``N * d * element_size`` bytes (see :mod:`lightning_fedhet.algorithms.fedstale`).

FedVARP is exactly ``FedStale(beta=1)``: it is implemented as that subclass, so
``FedStale(beta=1, weighting=w)`` and ``FedVARP(weighting=w)`` perform identical arithmetic. An empty
round leaves ``w`` unchanged by default (FedAU code: zero update); ``empty_round="stale"`` applies
``sum_j alpha_j y_j`` instead (the literal Eq. 7).
"""

from __future__ import annotations

import torch

from lightning_fedhet.algorithms.fedau import IntervalEstimator
from lightning_fedhet.algorithms.fedstale import FedStale


class FedVARP(FedStale):
    """SAGA-style variance reduction with one stored update per client (``FedStale`` with ``beta = 1``).

    Args:
        weighting: ``"participating"`` (default) or ``"known_p"``.
        p_source: ``"known"``, ``"fedau"`` or an :class:`IntervalEstimator` (``"known_p"`` only).
        fedau_K: cut-off of the ``"fedau"`` estimator.
        memory_dtype, memory_device: storage of the ``N x d`` memory.
        server_lr: ``eta_s > 0``.
        empty_round: ``"skip"`` (default) or ``"stale"``.
    """

    def __init__(
        self,
        weighting: str = "participating",
        p_source: str | IntervalEstimator = "known",
        fedau_K: int | None = 50,
        memory_dtype: torch.dtype = torch.float32,
        memory_device: str | torch.device = "cpu",
        server_lr: float = 1.0,
        empty_round: str = "skip",
    ) -> None:
        super().__init__(
            beta=1.0,
            weighting=weighting,
            p_source=p_source,
            fedau_K=fedau_K,
            memory_dtype=memory_dtype,
            memory_device=memory_device,
            server_lr=server_lr,
            empty_round=empty_round,
        )

    def hparams(self) -> dict:
        hp = super().hparams()
        del hp["beta"]
        return hp
