"""Step-length calibration of the FedACS paper (App. I.2).

Methods that sample and aggregate differently take steps of different *effective* length. In expectation a
round of each rule moves the model by ``-eta * E_step * sum_m Omega_m grad F_m`` (the paper's eq. (16) and its
analogues for the baselines), with the per-method effective step ``E_step = eta_eff * T_eff / eta``:

- ``fedavg`` (IS, ``p = omega``; rule ``(1/K) sum_{received} delta_m``): ``sum_m omega_m s_m a_m``;
- ``fedacs`` (FedACS sampling, ``(1/K) sum_{received} delta_m``): ``1 / sum_m omega_m / (s_m a_m)``;
- ``cafedavg`` (``(1/K) sum_{received} delta_m / s_m``): ``sum_m omega_m a_m``; ``fedvarp``: the same (paper:
  ``eta_4 = eta_3``);
- ``fednova`` (eq. (116a), ``tau_eff (1/K) sum_{received} delta_m / a_m``): ``sum_m omega_m s_m a_m``;
- ``fednova_arrived`` (``tau_eff sum_{received} q_m delta_m / a_m`` with ``q`` normalised over the arrived clients):
  ``sum_m omega_m s_m a_m / sum_m omega_m s_m``;
- ``fedau``, ``os``: not calibrated (paper: ``eta = eta_1``);

where ``omega`` are the target weights, ``s_m = 1 - q_m`` the probability that client ``m``'s update arrives,
``a_m = ||a_m||_1`` its local-solver accumulation norm (``T_m`` for plain SGD, see
:func:`~lightning_fedhet.algorithms.fednova.accumulation_norm`) and ``tau_eff = sum omega s a / sum omega s`` (the mean
``||a||_1`` of the received clients). ``fednova`` is the FedACS paper's FedNova, which divides by the ``K`` draws:
``FedNova(divisor="selected")``. The library's default ``FedNova()`` (``divisor="arrived"``, FedNova's reference code)
renormalises over the clients that arrived, so a lost upload does not shorten its step: its effective step is
``tau_eff`` itself, ``sum omega s a / sum omega s`` (to first order, for ``K`` draws from ``p = omega``), i.e.
``fednova_arrived``. The paper anchors every method to FedAvg's ``eta_1`` so all share FedAvg's effective step; the
resulting multipliers (:func:`lr_scalings`) are

- FedACS: ``[sum omega s a] * [sum omega / (s a)]`` (``>= 1`` by Cauchy-Schwarz),
- c-a-FedAvg and FedVarp: ``sum omega s a / sum omega a`` (``<= 1``),
- FedNova with the paper's divisor ``K``, FedAvg, FedAU, OS: ``1``,
- FedNova over the arrived clients: ``sum omega s`` (``<= 1``; 1 on lossless links).

**Client or server learning rate.** In the paper ``eta`` is the one learning rate of Algorithm 1 (the local step
*and* the scale of the update ``-eta Delta``), so the multiplier applies to it (``target="client"``). This is what
``FedACS(calibrate=True)`` / ``CAFedAvg(calibrate=True)`` (``True`` = ``"client"``) do every round: every client's
optimizer ``lr`` is multiplied by this round's factor for that round (the rule's ``client_lr_scale``, applied by
the engines), and the server step is not scaled. ``calibrate="server"`` (``target="server"``) multiplies the server
learning rate instead, which keeps every client's local trajectory identical across methods but agrees with the
client reading only to first order in ``eta * ||a||_1``, i.e. while an update grows linearly with its local steps.
Where updates saturate (many local steps, a large ``eta``) a server factor above 1 turns the average into an
extrapolation past the clients' own models: in the FedACS Fashion-MNIST study factors of 2.4-10.5 put weights up to
4 on single updates and 4 of 10 runs ended at chance. The client reading is not safe from large factors either:
in the same study (protocol v2) factors up to 10.5 on the clients' ``lr`` collapsed 3 of 10 dynamic runs; the rules'
``calibration_cap`` bounds the factor.

**Per-round or expected.** The paper drops the round index "for ease of writing". Pass this round's ``s`` and ``a``
to calibrate every round (used by the rules' ``calibrate=True``) or their expectations under the heterogeneity
generator (e.g. :meth:`~lightning_fedhet.system.steps.UniformSteps.expected`) for one fixed calibration.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torch import Tensor

from lightning_fedhet._checks import check_choice, check_vector, check_weights

METHODS = ("fedavg", "fedacs", "cafedavg", "fedvarp", "fednova", "fednova_arrived", "fedau", "os")
TARGETS = ("client", "server")


class LRScaling(NamedTuple):
    """Multipliers of the client and server learning rates for one method (one of them is always 1)."""

    client: float
    server: float


def _vectors(omega, success_probs, norms) -> tuple[Tensor, Tensor, Tensor]:
    """``omega`` normalised, ``s`` in ``(0, 1]`` and ``||a||_1 > 0`` per client (scalars broadcast), float64."""
    omega = check_weights(omega, "omega")
    n = omega.numel()
    success = check_vector(success_probs, "success_probs", 0.0, 1.0, low_open=True, num_clients=n)
    norms = check_vector(norms, "norms", 0.0, math.inf, low_open=True, num_clients=n)
    return omega, success, norms


def effective_step(method: str, omega, success_probs, norms) -> float:
    """``eta_eff * T_eff / eta`` of ``method`` (see the module table) for the given system state.

    Args:
        method: one of :data:`METHODS`.
        omega: target weights ``omega_m`` (normalised here), shape ``[M]``.
        success_probs: ``s_m = 1 - q_m`` in ``(0, 1]``, shape ``[M]`` or a scalar.
        norms: ``||a_m||_1 > 0`` (local steps for plain SGD), shape ``[M]`` or a scalar.
    """
    check_choice(method, "method", METHODS)
    omega, s, a = _vectors(omega, success_probs, norms)
    if method == "fedacs":
        return float(1.0 / (omega / (s * a)).sum())
    if method in ("cafedavg", "fedvarp"):
        return float((omega * a).sum())
    if method == "fednova_arrived":  # tau_eff: renormalised over the arrived clients
        return float((omega * s * a).sum() / (omega * s).sum())
    return float((omega * s * a).sum())


def lr_scalings(omega, success_probs, norms, target: str = "client") -> dict[str, LRScaling]:
    """Per-method learning-rate multipliers giving every method FedAvg's effective step (App. I.2).

    Args:
        omega: target weights, shape ``[M]``.
        success_probs: ``1 - q_m`` per client (this round's, or expected), shape ``[M]`` or scalar.
        norms: ``||a_m||_1`` per client (this round's, or expected), shape ``[M]`` or scalar.
        target: ``"client"`` (the paper: scale ``eta``, the local step) or ``"server"`` (scale the server step).

    Returns:
        ``{method: LRScaling(client=..., server=...)}`` for every method in :data:`METHODS`.

    Example::

        >>> sc = lr_scalings([0.5, 0.5], [1.0, 0.5], [1.0, 2.0])
        >>> round(sc["fedacs"].client, 6)    # (0.5*1 + 0.5*1) * (0.5/1 + 0.5/1)
        1.0
        >>> round(lr_scalings([0.5, 0.5], [1.0, 0.5], [1.0, 4.0])["fedacs"].client, 6)  # 1.5 * 0.75
        1.125
    """
    check_choice(target, "target", TARGETS)
    anchor = effective_step("fedavg", omega, success_probs, norms)
    out: dict[str, LRScaling] = {}
    for method in METHODS:
        factor = 1.0 if method in ("fedau", "os") else anchor / effective_step(method, omega, success_probs, norms)
        out[method] = LRScaling(client=factor, server=1.0) if target == "client" else LRScaling(1.0, factor)
    return out
