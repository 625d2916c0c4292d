"""The two ways of training several models on one client pool: FedAST and the synchronous Sync-ST.

Askin, Sharma, Joe-Wong, Joshi, "FedAST: Federated Asynchronous Simultaneous Training", UAI 2024.

- :class:`FedAST` (Algorithm 2): each task ``m`` keeps ``R_m`` requests in flight, buffers ``b_m`` arriving
  updates, then takes one server step ``x_m <- x_m + eta_s * mean(w_local - w_sent)`` (eq. 9: stale updates are
  applied as they are). Option ``"S"`` keeps ``R_m, b_m`` fixed; option ``"D"`` re-splits the request budget
  every ``0.75 * M * sum_m R_m`` updates (Algorithms 3-4).
- :class:`SyncST` (Sync-ST, Bhuyan et al. 2023, the paper's baseline): rounds; the round's clients are split
  at random across the tasks, every task runs synchronous FedAvg, optionally keeping only its first ``k``
  arrivals (the paper's straggler mitigation, ``k = 30``).

Both are configuration objects; :meth:`FedAST.build` / :meth:`SyncST.build` create the event-driven server
(:mod:`~lightning_fedhet.asynchronous.fedast_server`, :mod:`~lightning_fedhet.asynchronous.syncst_server`) on a
client pool (:mod:`~lightning_fedhet.asynchronous.pool`; default the paper's ``CappedPool(0.3)``). The pieces of
the dynamic allocation are plain functions in :mod:`~lightning_fedhet.asynchronous.allocation`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_fedhet._checks import check_choice
from lightning_fedhet.asynchronous.allocation import ALLOCATIONS
from lightning_fedhet.asynchronous.fedast_server import FedASTServer
from lightning_fedhet.asynchronous.pool import ClientPool, resolve_pool
from lightning_fedhet.asynchronous.syncst_server import SyncSTServer
from lightning_fedhet.participation.base import Participation

OPTIONS = ("S", "D")


def _positive_int(value: Any, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _per_task(value: Any, name: str) -> int | dict[str, int]:
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(f"{name} must not be an empty mapping")
        return {str(k): _positive_int(v, f"{name}[{k!r}]") for k, v in value.items()}
    return _positive_int(value, name)


class FedAST:
    """FedAST's server rule (paper Algorithm 2) as a configuration.

    Args:
        option: ``"S"`` static (``K_m = 1`` new request per arrival, ``R_m`` and ``b_m`` fixed) or ``"D"``
            dynamic (Algorithm 3 re-splits the budget; ``K_m = clip(R_m - in_flight_m, 0, max_new)``).
        requests: ``R_m^(0)``, requests kept in flight per task: one int for every task or a mapping task -> int.
        buffer: ``b_m^(0)``, updates per server step: an int or a mapping task -> int (``b = 1``: no buffer,
            the paper's "FedAST-NoBuffer"). The ratio ``R_m / b_m`` stays fixed under reallocation
            (Algorithm 3 line 4; the paper keeps it below ~37); option D needs it to be the same integer for
            every task.
        server_lr: ``eta_s > 0`` (paper: 0.1 with a buffer, 0.038 without).
        window: ``V``, the last updates per task used by the variance estimate (paper: 8).
        period: reallocation every ``period * M * sum_m R_m`` received updates, ``M`` = tasks still training
            (paper App. A: 0.75).
        allocation: ``"paper"``: ``R_m ∝ sigma_hat_m`` with ``sigma_hat_m^2 = eta_c eta_s tau sigma_tilde_m^2``
            (eq. 3 and Algorithm 4); ``"code"``: the authors' code, ``R_m ∝ eta_s sigma_tilde_m^2 /
            (eta_c tau^2)`` (its ``(...)**1/2`` parses as a halving, not a square root, so the rule is linear in
            the variance).
        quantum: every ``R_m`` is a multiple of ``quantum``. Default: ``R_m / b_m`` in option D (so ``b_m =
            R_m / (R/b)`` exactly; the authors' code: 32 = its ratio), 1 in option S (only a stopped task's
            requests are re-split there). In option D it must be a multiple of ``R_m / b_m``.
        max_new: the most new requests one arrival may send (paper: 2); in option S this only matters after the
            client pool skipped requests (they are made up at the task's next arrivals).

    Example::

        rule = FedAST(option="D", requests=96, buffer=3, server_lr=0.1)
        server = rule.build({"mnist": Task(x0, local_steps=27, latency=ShiftedExponential.fedast("mnist"))},
                            num_clients=1000, pool=CappedPool(0.3), seed=0)
    """

    def __init__(
        self,
        option: str = "S",
        requests: int | Mapping[str, int] = 96,
        buffer: int | Mapping[str, int] = 3,
        server_lr: float = 0.1,
        window: int = 8,
        period: float = 0.75,
        allocation: str = "paper",
        quantum: int | None = None,
        max_new: int = 2,
    ) -> None:
        check_choice(option, "option", OPTIONS)
        check_choice(allocation, "allocation", ALLOCATIONS)
        if not (math.isfinite(float(server_lr)) and float(server_lr) > 0):
            raise ValueError(f"server_lr must be a finite number > 0, got {server_lr!r}")
        if not (math.isfinite(float(period)) and float(period) > 0):
            raise ValueError(f"period must be a finite number > 0, got {period!r}")
        self.option = option
        self.requests = _per_task(requests, "requests")
        self.buffer = _per_task(buffer, "buffer")
        self.server_lr = float(server_lr)
        self.window = _positive_int(window, "window", low=2)
        self.period = float(period)
        self.allocation = allocation
        self.quantum = None if quantum is None else _positive_int(quantum, "quantum")
        if option == "D":  # Algorithm 3 line 4 keeps R_m / b_m fixed: refuse now what the server would refuse
            names = [m for m in (self.requests, self.buffer) if isinstance(m, dict)]
            keys = list(names[0]) if names else [""]
            get = lambda v, k: v[k] if isinstance(v, dict) else v  # noqa: E731
            if all(not isinstance(v, dict) or set(v) == set(keys) for v in (self.requests, self.buffer)):
                ratios = {k: get(self.requests, k) / get(self.buffer, k) for k in keys}
                first = next(iter(ratios.values()))
                if any(r != first for r in ratios.values()) or first != int(first):
                    raise ValueError(f"option D keeps R_m / b_m fixed, so requests / buffer must be the same integer "
                                     f"for every task; got {ratios}")
                if self.quantum is not None and self.quantum % int(first):
                    raise ValueError(f"quantum={self.quantum} must be a multiple of R_m / b_m = {int(first)} in "
                                     "option D")
        self.max_new = _positive_int(max_new, "max_new")

    def build(self, tasks: Mapping[str, Any], num_clients: int, participation: Participation | None = None,
              slot: float = 1.0, seed: int = 0, pool: ClientPool | None = None) -> FedASTServer:
        """The event-driven server for ``tasks`` (:class:`~.fedast_server.FedASTServer`); the first requests are
        sent. The client pool: ``pool``, or ``AvailabilityPool(participation, slot)`` when ``participation`` is
        given, else the paper's ``CappedPool(0.3)`` (:func:`~.pool.resolve_pool`)."""
        return FedASTServer(self, tasks, num_clients, pool=resolve_pool(pool, participation, slot), seed=seed)

    def __repr__(self) -> str:
        return (f"FedAST(option={self.option!r}, requests={self.requests}, buffer={self.buffer}, "
                f"server_lr={self.server_lr:g}, window={self.window}, period={self.period:g}, "
                f"allocation={self.allocation!r}, quantum={self.quantum}, max_new={self.max_new})")


class SyncST:
    """Synchronous simultaneous training (Sync-ST), the paper's baseline (§5.2, App. C).

    Round ``r``: the pool's clients of the round (``pool.round_clients(r)``; the paper's pool: 30 % of all
    clients, drawn uniformly), or ``clients_per_round`` of them drawn uniformly without replacement, are split
    at random across the tasks still training, task ``m`` getting
    ``n_m ≈ n * w_m / sum w`` of them (largest remainder). Every chosen client runs one request
    (its queue first: a client still busy with a discarded straggler starts later). Task ``m`` keeps its first
    ``first_k`` arrivals (all with ``first_k=None``) and takes the FedAvg step
    ``x_m <- x_m + server_lr * mean(kept deltas)``. The round ends when the last kept update of any task is in.

    Args:
        first_k: arrivals kept per task (the paper: 30), or None to wait for every client.
        clients_per_round: clients drawn among the available ones each round, or None for all of them.
        server_lr: ``eta_s > 0`` (paper: 1).
        weights: relative share of the round's clients per task (mapping task -> weight > 0); default equal.
    """

    def __init__(self, first_k: int | None = None, clients_per_round: int | None = None, server_lr: float = 1.0,
                 weights: Mapping[str, float] | None = None) -> None:
        self.first_k = None if first_k is None else _positive_int(first_k, "first_k")
        self.clients_per_round = None if clients_per_round is None else _positive_int(
            clients_per_round, "clients_per_round")
        if not (math.isfinite(float(server_lr)) and float(server_lr) > 0):
            raise ValueError(f"server_lr must be a finite number > 0, got {server_lr!r}")
        self.server_lr = float(server_lr)
        if weights is not None:
            weights = {str(k): float(v) for k, v in weights.items()}
            if not weights or any(not (math.isfinite(v) and v > 0) for v in weights.values()):
                raise ValueError(f"weights must map every task to a finite number > 0, got {weights!r}")
        self.weights = weights

    def build(self, tasks: Mapping[str, Any], num_clients: int, participation: Participation | None = None,
              slot: float = 1.0, seed: int = 0, pool: ClientPool | None = None) -> SyncSTServer:
        """The round-based server for ``tasks`` (:class:`~.syncst_server.SyncSTServer`); the pool as for
        :meth:`FedAST.build` (round ``r`` uses ``pool.round_clients(r)``; ``slot`` is unused)."""
        return SyncSTServer(self, tasks, num_clients, pool=resolve_pool(pool, participation, slot), seed=seed)

    def __repr__(self) -> str:
        return (f"SyncST(first_k={self.first_k}, clients_per_round={self.clients_per_round}, "
                f"server_lr={self.server_lr:g}, weights={self.weights})")
