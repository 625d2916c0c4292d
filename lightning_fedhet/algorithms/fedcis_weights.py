"""Fed-CIS's aggregation weights: the per-exit ``Lambda-tilde`` (``FedCIS(lambda_tilde=...)``, the table in
:mod:`lightning_fedhet.algorithms.fedcis`: serving rate, equal, FLOPS-proportional and Balanced Adj, each summing to
1), and the per-(node, exit) pair weights built from it (:func:`pair_weight_matrix`).

Decisions 6 and 7 of the rule (the thesis against the released code):

6. *FLOPS Prop.* ``flops_schedule="static"`` (default) is the thesis's description, ``Lt_e ∝ F_e``.
   ``"warmup"`` is the code's SDN schedule ``Lt_e(t) = min(0.01 (t + 1), F_e / F_E)``, normalised, ``t`` the
   0-based round (equal weights at round 0, the static ratios' shape only after ``~100`` rounds).
   ``F_e`` is whatever cost per exit the caller passes (e.g. ``EarlyExitNet.exit_flops((1, 28, 28))``, MACs);
   only ratios matter.
7. *Balanced Adj.* ``grad_variance`` is ``sigma2_e`` per exit. The default reproduces the released code, which
   uses Table D.1's CIFAR10 entries ``v = (0.00374, 0.00224, 0.00101)`` **squared** (``sigma2_e = v_e^2``, as if
   the table listed standard deviations): :data:`BALANCED_SIGMA2` ``["cifar10"]``; ``"cifar100"`` is also
   available. The code hard-codes ``sum (|D_i|/|D_e|)^2`` to the equal 4-2-1 tree (``0.25, 0.5, 1``); here it is
   computed from the actual sizes over ``C_e``, which gives the same values on the 7-node tree for every preset
   partition when ``p = 0`` (shares are split evenly within a layer) and differs on the 17-node tree or with
   ``p > 0``. Example, 80-15-5 CIFAR10: ``Lt ≈ (0.486, 0.195, 0.319)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedhet._checks import check_vector
from lightning_fedhet.algorithms.fedcis_exits import sampling_matrix
from lightning_fedhet.cis import CISTopology

__all__ = [
    "lambda_tilde_weights",
    "pair_weight_matrix",
    "check_exit_weights",
    "LAMBDA_TILDE_STRATEGIES",
    "FLOPS_SCHEDULES",
    "FLOPS_WARMUP_RATE",
    "TABLE_D1",
    "BALANCED_SIGMA2",
]

FLOPS_SCHEDULES = ("static", "warmup")
#: ``FedCIS(prob_weighting=...)``: divide a pair's weight by ``p_{i,e}`` (the thesis) or multiply by it (the code)
PROB_WEIGHTINGS = ("inverse", "direct")


#: Step of the code's FLOPS-Prop warm-up: ``tau(t) = FLOPS_WARMUP_RATE * (t + 1)``.
FLOPS_WARMUP_RATE = 0.01


#: Thesis Table D.1, per-exit gradient "variance" of the 3-exit ResNet-18 (CIFAR10 exits 3/9/17, CIFAR100 9/13/17).
TABLE_D1: dict[str, tuple[float, float, float]] = {
    "cifar10": (0.00374, 0.00224, 0.00101),
    "cifar100": (0.00216, 0.00126, 0.00101),
}


#: ``sigma2_e`` that the released code uses for Balanced Adj: Table D.1 entries squared.
BALANCED_SIGMA2: dict[str, tuple[float, ...]] = {k: tuple(v * v for v in vals) for k, vals in TABLE_D1.items()}


LAMBDA_TILDE_STRATEGIES = ("serving_rate", "equal", "flops", "balanced")


def check_exit_weights(name: str, values, length: int, positive: bool = False) -> Tensor:
    """One finite weight per exit, in ``[0, inf)`` (``(0, inf)`` when ``positive``), not all zero."""
    v = check_vector(values, name, 0.0, math.inf, low_open=positive, high_open=True)
    if v.numel() != length:
        raise ValueError(f"{name} must have one entry per exit ({length}), got {v.numel()}")
    if float(v.sum()) <= 0:
        raise ValueError(f"{name} must not be all zero, got {v.tolist()}")
    return v


def lambda_tilde_weights(
    strategy: str,
    topology: CISTopology,
    p_matrix: Tensor | None = None,
    sizes: Tensor | None = None,
    flops: Sequence[float] | Tensor | None = None,
    flops_schedule: str = "static",
    grad_variance: Sequence[float] | Tensor | None = None,
    round: int = 0,
) -> Tensor:
    """``Lambda-tilde`` (shape ``[E]``, float64, sums to 1) of a named strategy (see the module docstring).

    ``p_matrix`` (default: ``p = 0``) and ``sizes`` (``|D_i|``, default: ``topology.data_fraction``) only matter for
    ``"balanced"``; ``round`` only for ``"flops"`` with the ``"warmup"`` schedule.
    """
    num_exits = topology.num_exits
    if strategy == "serving_rate":
        return topology.serving_rates(normalize=True)
    if strategy == "equal":
        return torch.full((num_exits,), 1.0 / num_exits, dtype=torch.float64)
    if strategy == "flops":
        if flops is None:
            raise ValueError("lambda_tilde='flops' needs flops= (cost of each exit, e.g. EarlyExitNet.exit_flops(...))")
        f = check_exit_weights("flops", flops, num_exits, positive=True)
        if flops_schedule == "static":
            return f / f.sum()
        if flops_schedule == "warmup":
            w = torch.clamp(f / f[-1], max=FLOPS_WARMUP_RATE * (int(round) + 1))
            return w / w.sum()
        raise ValueError(f"flops_schedule must be one of {FLOPS_SCHEDULES}, got {flops_schedule!r}")
    if strategy == "balanced":
        if grad_variance is None:
            if num_exits != 3:
                raise ValueError(
                    f"lambda_tilde='balanced' has default gradient variances only for 3 exits (Table D.1); pass "
                    f"grad_variance= with {num_exits} values"
                )
            grad_variance = BALANCED_SIGMA2["cifar10"]
        elif isinstance(grad_variance, str):
            if grad_variance not in BALANCED_SIGMA2:
                raise ValueError(
                    f"grad_variance must be one of {sorted(BALANCED_SIGMA2)} or numbers, got {grad_variance!r}"
                )
            grad_variance = BALANCED_SIGMA2[grad_variance]
        sigma2 = check_exit_weights("grad_variance", grad_variance, num_exits, positive=True)
        mat = sampling_matrix(topology, 0.0) if p_matrix is None else p_matrix
        d = topology.data_fraction if sizes is None else torch.as_tensor(sizes, dtype=torch.float64)
        holders = mat > 0  # [N, E]: C_e
        d_e = (d[:, None] * holders).sum(0)  # |D_{e,p}|
        share = torch.where(d_e > 0, d[:, None] / d_e.clamp_min(1e-300), torch.zeros_like(mat)) * holders
        conc = (share**2).sum(0)  # sum_{i in C_e} (|D_i| / |D_{e,p}|)^2
        o = torch.where(conc > 0, 1.0 / (sigma2 * conc.clamp_min(1e-300)), torch.zeros_like(conc))
        if float(o.sum()) <= 0:
            raise ValueError("lambda_tilde='balanced': no exit has training data")
        lam = topology.serving_rates(normalize=True)
        w = 0.5 * (lam + o / o.sum())
        return w / w.sum()
    raise ValueError(
        f"lambda_tilde must be one of {LAMBDA_TILDE_STRATEGIES} or a tensor of {num_exits} weights, got {strategy!r}"
    )


def pair_weight_matrix(lambda_tilde: Tensor, sizes: Tensor, p_matrix: Tensor, prob_weighting: str) -> Tensor:
    """``[N, E]``: pair ``(i, e)``'s weight ``Lt_e |D_i| / |D_{e,p}| * (1/p_{i,e}`` for ``"inverse"``, ``p_{i,e}`` for
    ``"direct"``), with ``|D_{e,p}| = sum_{i : p_{i,e} > 0} |D_i|``; 0 where ``p_{i,e} = 0``."""
    holders = p_matrix > 0
    d_e = (sizes[:, None] * holders).sum(0)
    share = torch.where(d_e > 0, sizes[:, None] / d_e.clamp_min(1e-300), torch.zeros_like(p_matrix))
    if prob_weighting == "inverse":
        prob = torch.where(holders, 1.0 / p_matrix.clamp_min(1e-300), torch.zeros_like(p_matrix))
    else:
        prob = p_matrix
    return lambda_tilde[None, :] * share * prob * holders
