"""FedNova (Wang et al. 2020), the normalised-averaging baseline of the FedACS paper (Eq. 116).

Client ``i``'s delta after ``tau_i`` local steps is ``delta_i = -eta * G_i a_i`` (FedACS paper Eq. 2), so
``delta_i/||a_i||_1`` is its *normalised* update (one step's worth of averaged gradient) and ``tau_eff`` rescales the
average to a common number of steps, removing the "structural" bias of heterogeneous local work (FedAvg weights
client ``i`` by ``q_i ||a_i||_1``; FedNova by ``q_i``). With ``R_t`` the clients whose update arrived, ``S_t`` those
selected, ``r_i`` the raw weight (``alpha_i``, ``weighting="participating"``, default; or ``n_i``, ``"samples"``)::

    divisor="arrived" (default; FedNova's reference code over the clients that report):
        w_{t+1} = w_t + server_lr * tau_eff * sum_{i in R_t} (r_i / sum_{j in R_t} r_j) * delta_i / ||a_i||_1

    divisor="selected" (FedACS paper Eq. 116a: "(1/K) sum over the received" for K draws and uniform alpha):
        w_{t+1} = w_t + server_lr * tau_eff * sum_{i in R_t} (m_i alpha_i / sum_{j in S_t} m_j alpha_j)
                                                   * delta_i / ||a_i||_1

    tau_eff = sum_{i in R_t} r_i ||a_i||_1 / sum_{i in R_t} r_i      (both; the paper's mean over received clients)

``m_i`` is client ``i``'s multiplicity in ``RoundContext.selected`` (1 for a boolean mask; the number of draws when
it holds counts: the server passes a with-replacement sampler's draw counts through, so ``m_i > 1`` arises when the
round's clients were drawn with replacement, as in the FedACS paper's experiments). Under ``"selected"`` a selected
client whose update is lost contributes a zero update instead of having the others renormalised, so the step
shrinks by the lost share, as in Eq. 116a. It needs ``weighting="participating"`` (the sample counts of lost
clients are not reported; pass ``client_weights`` proportional to ``|D_i|`` instead). ``tau_i`` is
``ClientInfo.local_steps`` (the steps the client actually ran).

``||a_i||_1`` for the local solvers (FedACS paper §1.3, with the forms FedNova's paper gives):

=================================== ==================================================================
local solver                        ``||a||_1`` after ``tau`` steps
=================================== ==================================================================
SGD                                 ``tau``
SGD, momentum ``rho`` (PyTorch)     ``[tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)``
proximal SGD (``mu``, local lr eta)   ``[1 - (1 - eta mu)^tau] / (eta mu)``
momentum + proximal                 ``sum_k a_k`` from the exact linear recursion (see :func:`accumulation_norm`)
=================================== ==================================================================

These assume every client's solver starts fresh each round (zero momentum buffer) and is ``torch.optim.SGD`` with
the given momentum (no dampening, no Nesterov); :meth:`FedNova.check_client_solver` (through
:func:`check_optimizer_matches`) refuses an optimizer or an ``optimizer_state="persist"`` that breaks this. Weight
decay is part of the client's objective (it enters the gradient), as in FedNova's reference code, whose normaliser
ignores it; it is not checked.

With equal local work (``||a_i||_1`` the same for every arrived client) ``tau_eff / ||a_i||_1 = 1`` and FedNova with
``divisor="arrived"`` is ``FedAvg`` with the same weighting: ``FedNova()`` == ``FedAvg(weighting="participating")``
and ``FedNova(weighting="samples")`` == ``FedAvg(weighting="samples")``. A round in which nobody arrives leaves ``w``
unchanged. Learning-rate schedules inside a round (``a_t = eta_t/eta``) are not modelled.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice, check_real
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares
from lightning_fedhet.algorithms.weighting import check_weighting, raw_weight, weightings

NOVA_WEIGHTINGS = weightings("participating", "samples")
NOVA_DIVISORS = ("arrived", "selected")


def accumulation_norm(steps: int, momentum: float = 0.0, prox: float = 0.0) -> float:
    """``||a||_1`` of ``steps`` local steps of SGD with ``momentum`` and proximal factor ``prox = local_lr * mu``.

    Momentum is PyTorch's (``v <- rho v + g + mu (x - x0)``, ``x <- x - eta v``). Writing
    ``x_k - x_0 = -eta sum_j c_{k,j} g_j`` and ``v_k = sum_j b_{k,j} g_j``, the coefficient sums obey
    ``B_k = rho B_{k-1} + 1 - prox C_k``, ``C_{k+1} = C_k + B_k``, and ``||a||_1 = C_tau``: the exact ``sum_j a_j``
    of the unrolled solver (all ``a_j >= 0`` in the pure momentum and pure proximal cases). For the mixed case
    FedNova's reference code does **not** compute this: it accumulates ``vec <- (1 - eta mu)(vec + b_k) + 1`` per step
    (``b_k = 1 + rho + ... + rho^{k-1}``), an approximation; the pure cases agree with it.
    """
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"local_steps must be >= 1 for FedNova's normalisation, got {steps}")
    rho, c = float(momentum), float(prox)
    if rho == 0.0 and c == 0.0:
        return float(steps)
    if c == 0.0:
        return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)
    if rho == 0.0:
        return (1.0 - (1.0 - c) ** steps) / c
    b = total = 0.0
    for _ in range(steps):
        b = rho * b + 1.0 - c * total
        total += b
    return total


def check_local_solver(momentum: float, prox_mu: float, local_lr: float | None) -> None:
    """Validate the local-solver description that :func:`accumulation_norm` needs (FedNova, FedACS)."""
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if isinstance(prox_mu, bool) or not isinstance(prox_mu, numbers.Real) or not prox_mu >= 0.0:
        raise ValueError(f"prox_mu must be >= 0, got {prox_mu!r}")
    if local_lr is not None:
        local_lr = check_real(local_lr, "local_lr", 0.0, low_open=True, high_open=True)
    if prox_mu > 0:
        if local_lr is None:
            raise ValueError("prox_mu > 0 needs local_lr (the client learning rate) to compute ||a_i||_1")
        if not local_lr * prox_mu <= 1.0:
            raise ValueError(f"local_lr * prox_mu must be in (0, 1], got {local_lr * prox_mu}")


def check_optimizer_matches(
    rule: str,
    optimizer: torch.optim.Optimizer,
    optimizer_state: str,
    momentum: float,
    prox_mu: float = 0.0,
    local_lr: float | None = None,
) -> None:
    """Refuse a client optimizer whose ``||a||_1`` differs from the one :func:`accumulation_norm` computes.

    ``rule`` names the caller in the messages (``"FedNova"``, ``"FedACS"``). The closed forms assume
    ``torch.optim.SGD`` with the rule's ``momentum`` in every parameter group, no dampening, no Nesterov, a momentum
    buffer that restarts every round (``optimizer_state="reset"``), and, when ``prox_mu > 0``, the learning rate
    ``local_lr``. Weight decay is not checked (it is part of the client's objective). Raises ``ValueError`` naming
    both values of each mismatch.
    """
    check_choice(optimizer_state, "optimizer_state", ("reset", "persist"))
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            f"{rule}'s ||a_i||_1 models torch.optim.SGD (with momentum and a proximal term), but the module's "
            f"optimizer is {type(optimizer).__name__}"
        )
    for k, group in enumerate(optimizer.param_groups):
        where = f" (param group {k})" if len(optimizer.param_groups) > 1 else ""
        if float(group["momentum"]) != float(momentum):
            raise ValueError(
                f"{rule}(momentum={momentum}) does not match the optimizer's momentum={group['momentum']}{where}: "
                f"||a_i||_1 would be wrong; pass {rule}(momentum={group['momentum']})"
            )
        if float(group["momentum"]) > 0 and (float(group.get("dampening", 0.0)) != 0.0 or group.get("nesterov")):
            raise ValueError(
                f"{rule}'s ||a_i||_1 models PyTorch momentum without dampening or Nesterov; the optimizer has "
                f"dampening={group.get('dampening')}, nesterov={group.get('nesterov')}{where}"
            )
        if prox_mu > 0 and local_lr is not None and float(group["lr"]) != float(local_lr):
            raise ValueError(
                f"{rule}(local_lr={local_lr}) does not match the optimizer's lr={group['lr']}{where}: the proximal "
                f"term's ||a_i||_1 depends on eta * mu"
            )
    if optimizer_state == "persist" and momentum > 0:
        raise ValueError(
            f"{rule}(momentum={momentum}) assumes every client's momentum buffer restarts each round (its ||a_i||_1 "
            "is that of a fresh solver), but optimizer_state='persist' carries the buffers across rounds; use "
            "optimizer_state='reset'"
        )


class FedNova(Algorithm):
    """Normalised averaging: each delta divided by its client's ``||a_i||_1``, the average rescaled by ``tau_eff``.

    Args:
        momentum: local SGD momentum ``rho`` in ``[0, 1)`` (PyTorch convention, no dampening).
        prox_mu: FedProx proximal coefficient ``mu >= 0`` of the local solver.
        local_lr: client learning rate ``eta``; required when ``prox_mu > 0`` (with ``0 < eta * mu <= 1``).
        weighting: ``"participating"`` (``alpha_i``, default) or ``"samples"`` (``n_i``).
        server_lr: ``eta_s > 0``.
        divisor: ``"arrived"`` (weights normalised over the clients that arrived, default) or ``"selected"``
            (normalised over the selected clients, FedACS paper Eq. 116a; ``weighting="participating"`` only). See
            the module docstring.

    Example::

        >>> import torch
        >>> algo = FedNova()
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> algo.open_round(0, None)
        >>> algo.add(0, torch.tensor([1.0]), ClientInfo(1, local_steps=1))
        >>> algo.add(1, torch.tensor([3.0]), ClientInfo(1, local_steps=3))
        >>> algo.close_round()    # tau_eff = 2; 2 * (0.5 * 1/1 + 0.5 * 3/3)
        tensor([2.])
    """

    shares_rounds = True

    def __init__(
        self,
        momentum: float = 0.0,
        prox_mu: float = 0.0,
        local_lr: float | None = None,
        weighting: str = "participating",
        server_lr: float = 1.0,
        divisor: str = "arrived",
    ) -> None:
        super().__init__()
        check_local_solver(momentum, prox_mu, local_lr)
        check_weighting(weighting, NOVA_WEIGHTINGS)
        check_choice(divisor, "divisor", NOVA_DIVISORS)
        if divisor == "selected" and weighting != "participating":
            raise ValueError(
                "divisor='selected' needs weighting='participating' (the sample counts of lost clients are not "
                "reported; pass client_weights proportional to |D_i| instead)"
            )
        self.divisor = divisor
        server_lr = check_real(server_lr, "server_lr", 0.0, low_open=True, high_open=True)  # local_lr: checked above
        self.momentum = float(momentum)
        self.prox_mu = float(prox_mu)
        self.local_lr = None if local_lr is None else float(local_lr)
        self.weighting = weighting
        self.server_lr = float(server_lr)
        self._prox = self.prox_mu * self.local_lr if self.prox_mu > 0 else 0.0
        self._norms: dict[int, float] = {}
        self._sum: WeightedSum | None = None
        self._client_norms: dict[int, float] = {}
        self._selected_weight: float | None = None
        self._multiplicity: Tensor | None = None
        self.last_tau_eff: float | None = None

    def hparams(self) -> dict:
        return {
            "momentum": self.momentum,
            "prox_mu": self.prox_mu,
            "local_lr": self.local_lr,
            "weighting": self.weighting,
            "server_lr": self.server_lr,
            "divisor": self.divisor,
        }

    def norm(self, local_steps: int) -> float:
        """``||a||_1`` of this solver after ``local_steps`` steps (cached)."""
        steps = int(local_steps)
        if steps not in self._norms:
            self._norms[steps] = accumulation_norm(steps, self.momentum, self._prox)
        return self._norms[steps]

    def check_client_solver(self, optimizer: torch.optim.Optimizer, optimizer_state: str) -> None:
        """Refuse an optimizer or ``optimizer_state="persist"`` that ``||a_i||_1`` does not describe
        (:func:`check_optimizer_matches`)."""
        check_optimizer_matches("FedNova", optimizer, optimizer_state, self.momentum, self.prox_mu, self.local_lr)

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        self._selected_weight = None
        if self.divisor == "selected":
            selected = None if ctx is None else ctx.selected
            if selected is None:
                raise ValueError("FedNova(divisor='selected') needs RoundContext.selected (the K selected clients)")
            self._multiplicity = torch.as_tensor(selected).flatten().to(device="cpu", dtype=torch.float64)
            if self._multiplicity.numel() != self.num_clients:
                raise ValueError(f"RoundContext.selected must have num_clients={self.num_clients} entries")
            # sum_{j in S_t} m_j alpha_j (K / N for K uniform draws and uniform alpha)
            self._selected_weight = float((self._multiplicity * self.client_weights).sum())
        self._sum = WeightedSum(self.params)
        self._client_norms = {}

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._sum)
        a = self.norm(info.local_steps)
        raw = raw_weight(self.weighting, float(self.client_weights[client]), info.num_samples)
        if self._selected_weight is not None:
            m = float(self._multiplicity[client])
            if not m > 0:
                raise ValueError(f"client {client} arrived but is not in RoundContext.selected (divisor='selected')")
            raw *= m  # a client drawn m_i times counts m_i times (Eq. 116a)
        self._client_norms[client] = a
        self._sum.add(client, delta, raw, coef=raw / a)  # records q_i (unnormalised), adds q_i delta_i / ||a_i||_1

    def round_shares(self) -> RoundShares:
        shares = self._sum.shares()
        shares.tables.append(self._client_norms)
        return shares

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        total = self._sum.weight_sum
        if total > 0:
            tau_eff = sum(r * self._client_norms[c] for c, r in self._sum.weights.items()) / total
            if self._selected_weight is None:
                scale = tau_eff / total
            else:
                # raw weights are m_i alpha_i; the divisor is the selected weight, not the arrived one. It is > 0
                # here: every arrived client is in S_t (add() refuses the others), so it is >= total > 0.
                scale = tau_eff / self._selected_weight
            self.last_weights = {c: r * scale / self._client_norms[c] for c, r in self._sum.weights.items()}
            self.params = self.params + (self.server_lr * scale) * self._sum.total
        else:
            self.last_weights = {}
        self.last_tau_eff = tau_eff if total > 0 else None
        self._sum = None
        return self.params
