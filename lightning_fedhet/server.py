"""The federated server: owns the round, the global model and everything a real server would know.

Framework-free (no Lightning): it deals in flat vectors ``[d]`` (parameters first, then floating buffers such as
BatchNorm statistics, see :class:`~lightning_fedhet.flat.FlatModel`) and client ids. An engine drives it::

    plan = server.begin_round(t)                    # availability -> selection -> links -> local steps
    for client in plan.trained_ids:                 # in any order, any grouping
        start = server.start_client(client)         # global vector, the rule's config, optimizer state
        ... train from start.global_vector ...
        server.submit(client, delta, loss)          # lost upload / non-finite rejection / into the rule
    new_global = server.close_round()               # w_{t+1}, recorded in server.history

Parameters go through the algorithm. Floating buffers never do: they are averaged over the arrived clients
with normalised, non-negative sample weights ``|D_i| / sum_{arrived} |D_j|`` whatever the rule, because the
unbiased or corrective weights of the rules (``1/p_i``, ``1/(1 - q_i)``, ``1/||a_i||_1`` ...) need not sum to one
and would drive a running variance negative. Integer buffers (``num_batches_tracked``, a counter kept by
``training_step``) are global state too: every client starts from the global value, and the server moves it by
the same sample-weighted mean of the clients' changes, rounded to the nearest integer, so a counter is never
summed over clients.

A rule whose clients train different sub-models (Fed-CIS: each node trains one exit) sets
:attr:`~lightning_fedhet.algorithms.base.Algorithm.buffers_per_submodel`: then each buffer entry is averaged only over
the arrived clients that changed it (those whose sub-model holds it), with the same sample weights normalised over
those clients, so a deep exit's BatchNorm statistics are not pulled towards the global values by every client that
trained a shallower exit.

Robustness: an update that is not finite, or whose parameter norm exceeds ``max_update_norm`` (with
``update_norm_action="reject"``), is rejected and counted (``rejected_total``, ``history[t]["rejected"]``); with
``"clip"`` it is scaled down to the bound instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundShares
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import RoundPlan, RoundPlanner
from lightning_fedhet.flat import all_finite, rows_finite
from lightning_fedhet.history import round_record

OPTIMIZER_STATES = ("reset", "persist")
CLIENT_WEIGHTS = ("uniform", "samples")
UPDATE_NORM_ACTIONS = ("reject", "clip")
#: per-client server memory above which the server suggests a smaller memory dtype
LARGE_MEMORY_BYTES = 256 * 2**20


@dataclass
class ClientStart:
    """What a client receives when it starts training in a round.

    Attributes:
        client: the client id.
        global_vector: the global model ``w_t`` as a flat vector ``[d]`` (do not modify it).
        config: the rule's instructions for this client (e.g. Fed-CIS's ``{"train_exit": e}``); ``{}`` if none.
        optimizer_state: the client's own optimizer state to restore (``optimizer_state="persist"``), or ``None``
            to start from a fresh optimizer state.
        int_buffers: the global integer buffers, int64 ``[m]``.
    """

    client: int
    global_vector: Tensor
    config: dict = field(default_factory=dict)
    optimizer_state: list[dict] | None = None
    int_buffers: Tensor | None = None


class Server:
    """Owns the rounds of one federated run.

    Args:
        planner: draws each round's plan (participation, selection, links, local steps).
        algorithm: the server rule; it sees the parameter part ``[:num_parameters]`` of the vector.
        init_vector: the initial global vector ``w_0``, shape ``[d]``.
        num_parameters: how many leading entries of the vector are parameters (the rest are floating buffers).
        client_weights: ``"uniform"`` (``alpha_i = 1/N``) or ``"samples"`` (``alpha_i = |D_i| / |D|``).
        optimizer_state: ``"reset"`` (each client starts every round with a fresh optimizer state) or
            ``"persist"`` (the server keeps each client's optimizer state between its rounds).
        init_ints: the initial integer buffers, int64 ``[m]`` (none by default).
        max_update_norm: optional bound on the L2 norm of a client's parameter update.
        update_norm_action: ``"reject"`` (count it like a non-finite update) or ``"clip"`` (scale it to the bound).

    Attributes:
        history: one dict per closed round (see :func:`~lightning_fedhet.history.round_record`).
        rejected_total: client updates rejected as non-finite so far.
        next_round: the round :meth:`begin_round` will be asked for next.
        plan: the open round's plan (``None`` between rounds).
        current_client: the client whose training started last in the open round (``None`` between rounds).
    """

    def __init__(
        self,
        planner: RoundPlanner,
        algorithm: Algorithm,
        init_vector: Tensor,
        num_parameters: int,
        client_weights: str = "uniform",
        optimizer_state: str = "reset",
        init_ints: Tensor | None = None,
        max_update_norm: float | None = None,
        update_norm_action: str = "reject",
    ) -> None:
        check_server_options(optimizer_state, client_weights, max_update_norm, update_norm_action)
        self.max_update_norm = None if max_update_norm is None else float(max_update_norm)
        self.update_norm_action = update_norm_action
        self.global_ints = torch.zeros(0, dtype=torch.int64) if init_ints is None else init_ints.clone()
        self.planner = planner
        self.algorithm = algorithm
        self.num_parameters = int(num_parameters)
        self.optimizer_state = optimizer_state
        self.global_vector = init_vector.detach().clone()
        sizes = torch.tensor(planner.client_sizes, dtype=torch.int64)
        alpha = sizes.to(torch.float64) if client_weights == "samples" else None
        algorithm.setup(planner.num_clients, self.global_vector[: self.num_parameters], alpha, sizes)
        if algorithm.memory_bytes > LARGE_MEMORY_BYTES:
            warnings.warn(
                f"{type(algorithm).__name__} keeps {algorithm.memory_bytes / 2**20:.0f} MiB of per-client state "
                f"(N x d = {planner.num_clients} x {self.num_parameters}), and every checkpoint carries it: pass "
                "memory_dtype=torch.bfloat16 to halve it",
                stacklevel=2,
            )
        self.history: list[dict] = []
        self.rejected_total = 0
        self.next_round = 0
        self.plan: RoundPlan | None = None
        self.current_client: int | None = None
        self._client_optimizer_states: dict[int, list[dict]] = {}
        self._received: list[int] = []
        self._rejected: list[int] = []
        self._buffer_sum: Tensor | None = None
        self._int_sum: Tensor | None = None
        # per-entry sample weights of the buffers' average (rules with buffers_per_submodel only)
        self._buffer_weight: Tensor | None = None
        self._int_weight: Tensor | None = None

    # ------------------------------------------------------------------ facts
    @property
    def streams(self) -> ClientStreams | None:
        """The clients' data streams (``None`` when the clients train elsewhere and the server knows their sizes)."""
        return self.planner.streams

    @property
    def client_sizes(self) -> np.ndarray:
        """``|D_i|`` of each client, int64 ``[N]`` (read-only numpy array)."""
        return self.planner.client_sizes

    @property
    def num_clients(self) -> int:
        return self.planner.num_clients

    @property
    def round_open(self) -> bool:
        """Whether a round has begun and not yet closed."""
        return self.plan is not None

    @property
    def model_bytes(self) -> int:
        """Bytes of one model transfer (the whole vector)."""
        return self.global_vector.numel() * self.global_vector.element_size()

    # ------------------------------------------------------------------ the round
    def begin_round(self, round: int, probe: Callable[[int, Tensor], Tensor] | None = None) -> RoundPlan:
        """Plan round ``round`` and open the algorithm's aggregation for it.

        Args:
            round: 0-based round index (normally :attr:`next_round`).
            probe: the engine's one-batch loss of every available client at ``w_t`` (see
                :meth:`RoundPlanner.plan`); only called when the rule asks for it.
        """
        if self.round_open:
            raise RuntimeError(f"round {self.plan.round} is still open")
        plan = self.planner.plan(round, probe)
        self.plan = plan
        self.current_client = None
        self._received, self._rejected = [], []
        self._buffer_sum, self._int_sum = None, None
        self._buffer_weight, self._int_weight = None, None
        self.algorithm.open_round(round, self.planner.context(plan))
        return plan

    def start_client(self, client: int) -> ClientStart:
        """Everything ``client`` receives before its first local step; every engine calls this."""
        self._check_open()
        self.current_client = int(client)
        state = self._client_optimizer_states.get(client) if self.optimizer_state == "persist" else None
        config = self.algorithm.client_config(int(client))
        return ClientStart(int(client), self.global_vector, config, state, self.global_ints)

    def submit(
        self,
        client: int,
        delta: Tensor,
        loss: float,
        optimizer_state: list[dict] | None = None,
        int_delta: Tensor | None = None,
    ) -> bool:
        """One trained client's update ``delta = w_i - w_t`` (shape ``[d]``) goes up.

        It is dropped when the uplink was lost or the deadline missed (the work is wasted), rejected and counted
        when it is not finite or too large (the global model never sees it), and streamed into the algorithm
        otherwise. ``int_delta`` is the change of the integer buffers (int64 ``[m]``). Returns whether it was
        aggregated.
        """
        return self._take(client, delta, loss, optimizer_state, int_delta, finite=None)

    def submit_cohort(
        self,
        clients: Sequence[int],
        deltas: Tensor,
        losses: Sequence[float],
        int_deltas: Tensor | None = None,
        optimizer_states: Sequence[list[dict] | None] | None = None,
    ) -> list[bool]:
        """Several trained clients' updates at once: row ``k`` of ``deltas`` (``[C, d]``) is client ``clients[k]``'s,
        row ``k`` of ``int_deltas`` (int64 ``[C, m]``, optional) the change of its integer buffers, entry ``k`` of
        ``optimizer_states`` (optional) its optimizer state as :meth:`submit` takes it.

        The same as :meth:`submit` for each row in order, with one finiteness check and one host sync for the whole
        cohort. Returns whether each update was aggregated.
        """
        if deltas.dim() != 2 or deltas.shape[0] != len(clients) or len(losses) != len(clients):
            raise ValueError(
                f"submit_cohort needs one delta row and one loss per client: {len(clients)} clients, deltas of "
                f"shape {tuple(deltas.shape)}, {len(losses)} losses"
            )
        self._check_open()
        if optimizer_states is not None and len(optimizer_states) != len(clients):
            raise ValueError(
                f"submit_cohort needs one optimizer state per client: {len(clients)} clients, "
                f"{len(optimizer_states)} optimizer states"
            )
        finite = rows_finite(deltas).tolist()
        ints = [None] * len(clients) if int_deltas is None else int_deltas
        states = [None] * len(clients) if optimizer_states is None else optimizer_states
        return [
            self._take(client, delta, loss, state, int_delta, finite=ok)
            for client, delta, loss, int_delta, state, ok in zip(clients, deltas, losses, ints, states, finite)
        ]

    def _take(
        self,
        client: int,
        delta: Tensor,
        loss: float,
        optimizer_state: list[dict] | None,
        int_delta: Tensor | None,
        finite: bool | None,
    ) -> bool:
        """:meth:`submit`'s work; ``finite`` is the update's finiteness when the caller already checked it."""
        self._check_open()
        if optimizer_state is not None and self.optimizer_state == "persist":
            self._client_optimizer_states[client] = optimizer_state
        if not bool(self.plan.arrives[client]):
            return False
        if not (all_finite(delta) if finite is None else finite):
            self._reject(client)
            return False
        if self.max_update_norm is not None:
            norm = float(torch.linalg.vector_norm(delta[: self.num_parameters].to(torch.float64)))
            if norm > self.max_update_norm:
                if self.update_norm_action == "reject":
                    self._reject(client)
                    return False
                delta = delta.clone()
                delta[: self.num_parameters] *= self.max_update_norm / norm
        num_samples = int(self.client_sizes[client])
        info = ClientInfo(num_samples=num_samples, local_steps=int(self.plan.local_steps[client]), loss=float(loss))
        self.algorithm.add(client, delta[: self.num_parameters], info)
        per_submodel = self.algorithm.buffers_per_submodel
        if self.global_vector.numel() > self.num_parameters:
            change = delta[self.num_parameters :].to(torch.float64)
            buffers = change * num_samples
            self._buffer_sum = buffers if self._buffer_sum is None else self._buffer_sum.add_(buffers)
            if per_submodel:
                held = (change != 0).to(torch.float64) * num_samples
                self._buffer_weight = held if self._buffer_weight is None else self._buffer_weight.add_(held)
        if int_delta is not None and int_delta.numel():
            weighted = int_delta.to(torch.float64) * num_samples
            self._int_sum = weighted if self._int_sum is None else self._int_sum.add_(weighted)
            if per_submodel:
                held = (int_delta != 0).to(torch.float64) * num_samples
                self._int_weight = held if self._int_weight is None else self._int_weight.add_(held)
        self._received.append(client)
        return True

    def _reject(self, client: int) -> None:
        self._rejected.append(client)

    def round_shares(self) -> RoundShares:
        """This process's part of the open round when its clients are split over several processes: the sums of the
        buffers' sample-weighted changes, the received and rejected ids, then the algorithm's
        :meth:`~lightning_fedhet.algorithms.base.Algorithm.round_shares`. The many-process strategy combines every
        process's shares in place before :meth:`close_round` (see
        :class:`~lightning_fedhet.algorithms.base.RoundShares`)."""
        self._check_open()
        vector = self.global_vector
        if self._buffer_sum is None:
            size = vector.numel() - self.num_parameters
            self._buffer_sum = torch.zeros(size, dtype=torch.float64, device=vector.device)
        if self._int_sum is None:
            self._int_sum = torch.zeros(self.global_ints.numel(), dtype=torch.float64, device=self.global_ints.device)
        sums = [self._buffer_sum, self._int_sum]
        if self.algorithm.buffers_per_submodel:
            if self._buffer_weight is None:
                self._buffer_weight = torch.zeros_like(self._buffer_sum)
            if self._int_weight is None:
                self._int_weight = torch.zeros_like(self._int_sum)
            sums += [self._buffer_weight, self._int_weight]
        own = RoundShares(sums=sums, tables=[self._received, self._rejected])
        return own.extend(self.algorithm.round_shares())

    def close_round(self, complete: bool = True) -> Tensor:
        """Aggregate, record and return the new global vector ``w_{t+1}`` (shape ``[d]``).

        Args:
            complete: False when the round was cut short (clients that had not finished count as not arrived);
                recorded in the history entry.
        """
        self._check_open()
        plan = self.plan
        params = self.algorithm.close_round()
        if not all_finite(params):
            raise FloatingPointError(f"round {plan.round}: the algorithm produced non-finite global parameters")
        vector = self.global_vector.clone()
        vector[: self.num_parameters] = params.to(vector)
        # the sample weights of the buffers' average: |D_i| of every received client
        weight = float(sum(int(self.client_sizes[client]) for client in self._received))
        if self._buffer_sum is not None and weight > 0:
            vector[self.num_parameters :] += _weighted_mean(self._buffer_sum, weight, self._buffer_weight).to(vector)
        if self._int_sum is not None and weight > 0:
            mean = _weighted_mean(self._int_sum, weight, self._int_weight)
            self.global_ints = self.global_ints + torch.round(mean).to(torch.int64)
        self.global_vector = vector
        self.rejected_total += len(self._rejected)
        previous = self.history[-1]["sim_time"] if self.history else 0.0
        record = round_record(
            plan,
            self._received,
            self._rejected,
            self.algorithm.last_weights,
            self.model_bytes,
            previous,
            self.algorithm.memory_bytes,
            complete,
        )
        self.history.append(record)
        self.plan = None
        self.current_client = None
        self.next_round = plan.round + 1
        return self.global_vector

    def _check_open(self) -> None:
        if self.plan is None:
            raise RuntimeError("no round is open: call begin_round() first")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Global vector, algorithm state, history and per-client optimizer states (tensors and primitives)."""
        if self.round_open:
            raise RuntimeError(
                f"the server state was requested in the middle of round {self.plan.round}: checkpoints are taken "
                "at round ends (e.g. ModelCheckpoint(every_n_epochs=1), not every_n_train_steps or "
                "train_time_interval)"
            )
        return {
            "global_vector": self.global_vector.clone(),
            "global_ints": self.global_ints.clone(),
            "algorithm": self.algorithm.state_dict(),
            "history": list(self.history),
            "rejected_total": self.rejected_total,
            "next_round": self.next_round,
            "client_optim_states": dict(self._client_optimizer_states),
        }

    def load_state_dict(self, state: dict) -> None:
        self.algorithm.load_state_dict(state["algorithm"])
        self.global_vector = state["global_vector"].clone()
        self.global_ints = state["global_ints"].clone()
        self.history = list(state["history"])
        self.rejected_total = int(state["rejected_total"])
        self.next_round = int(state["next_round"])
        self._client_optimizer_states = dict(state["client_optim_states"])
        self.plan = None


def _weighted_mean(total: Tensor, weight: float, per_entry: Tensor | None) -> Tensor:
    """``total / weight``, or ``total / per_entry`` entry by entry (0 where no client holds the entry)."""
    if per_entry is None:
        return total / weight
    return torch.where(per_entry > 0, total / per_entry.clamp_min(1.0), torch.zeros_like(total))


def check_server_options(
    optimizer_state: str, client_weights: str, max_update_norm: float | None, update_norm_action: str
) -> None:
    """Validate the server's options (each error names the parameter and the allowed values); the one check of
    them, run by the :class:`Server` and, before any work, by :class:`~lightning_fedhet.spec.FederationSpec`."""
    check_choice(optimizer_state, "optimizer_state", OPTIMIZER_STATES)
    check_choice(client_weights, "client_weights", CLIENT_WEIGHTS)  # a typo would otherwise run uniform weights
    check_choice(update_norm_action, "update_norm_action", UPDATE_NORM_ACTIONS)
    if max_update_norm is not None:
        if isinstance(max_update_norm, bool) or not isinstance(max_update_norm, (int, float)):
            raise TypeError(f"max_update_norm must be a number > 0 or None, got {max_update_norm!r}")
        if not float(max_update_norm) > 0 or max_update_norm == float("inf"):
            raise ValueError(f"max_update_norm must be a finite number > 0, got {max_update_norm!r}")
