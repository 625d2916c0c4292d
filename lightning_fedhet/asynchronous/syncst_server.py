"""SyncSTServer: the synchronous baseline Sync-ST (rounds, first-k) on the same virtual clock as FedAST."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Protocol

import numpy as np
from torch import Tensor

from lightning_fedhet.asynchronous.allocation import split_budget
from lightning_fedhet.asynchronous.pool import ClientPool
from lightning_fedhet.asynchronous.task import Request, Task
from lightning_fedhet.asynchronous.task_server import TaskServer
from lightning_fedhet.participation.uniform import UniformSample
from lightning_fedhet.seeding import Stream, generator

#: How many empty Sync-ST rounds in a row before the run is declared stuck.
MAX_WAIT = 100_000


class SyncSTSettings(Protocol):
    """What the server reads from its rule (:class:`~lightning_fedhet.asynchronous.SyncST` validates them)."""

    first_k: int | None
    clients_per_round: int | None
    server_lr: float
    weights: Mapping[str, float] | None


class SyncSTServer(TaskServer):
    """Sync-ST (see :class:`~.rules.SyncST`) on the virtual clock. Built by :meth:`SyncST.build`.

    Round ``r`` uses the pool's ``round_clients(r)`` (:class:`~.pool.CappedPool`: ``fraction * N`` clients drawn
    uniformly, busy ones included; :class:`~.pool.AvailabilityPool`: the available ones), of which
    ``clients_per_round`` when set, split at random across the tasks still training.

    The kept requests of a round are handed out task after task, each task's in client-id order (a synchronous
    server aggregates at the round's end, so the order only fixes the summation order; it is FedAvg's). The last
    one ``closes`` the round: every task with kept updates steps, and the clock jumps to the round's end (the
    last kept arrival over all tasks). Discarded stragglers are never trained (their work is wasted) but keep
    their client busy. Each request's data key is the round.

    ``history`` holds one dict per task per round: ``task``, ``round`` (``t_m`` after the step), ``sim_time``,
    ``requests``/``clients``/``staleness`` (0) of the kept updates, ``rejected``, ``loss``, ``R`` (clients
    assigned to the task), ``b`` (updates kept), ``sync_round``.
    """

    def __init__(self, rule: SyncSTSettings, tasks: Mapping[str, Task], num_clients: int,
                 pool: ClientPool | None = None, seed: int = 0) -> None:
        super().__init__(tasks, num_clients, pool, seed)
        if rule.weights is not None and set(rule.weights) != set(self.names):
            raise ValueError(f"weights name tasks {sorted(rule.weights)}, but the tasks are {self.names}")
        self.rule = rule
        self.sync_round = 0
        self._plan: list[Request] | None = None
        self._assigned: dict[str, int] = {}
        self._round_end = 0.0
        self._position = 0
        self._selector = None if rule.clients_per_round is None else UniformSample(rule.clients_per_round)
        if self._selector is not None:
            self._selector.setup(self.num_clients, self.seed)

    def _plan_round(self) -> None:
        r = self.sync_round
        available = self.pool.round_clients(r)
        if self._selector is not None:
            # the same draw as FedHetStrategy(selection=UniformSample(k)) in round r
            available = self._selector.choose(available, generator(self.seed, Stream.SELECTION, r))
        ids = np.flatnonzero(available)
        active = self.active_tasks
        weights = {n: 1.0 if self.rule.weights is None else self.rule.weights[n] for n in active}
        counts = split_budget(len(ids), weights, minimum=0) if ids.size else {n: 0 for n in active}
        order = generator(self.seed, Stream.REQUEST_CLIENT, r).permutation(ids)
        plan, offset, round_end = [], 0, self.clock
        self._assigned = counts
        for n in active:
            clients = np.sort(order[offset: offset + counts[n]])
            offset += counts[n]
            jobs = [self._make_request(n, int(c), self.clock, data_key=r) for c in clients]
            kept = sorted(jobs, key=lambda q: (q.finish_at, q.seq))[: self.rule.first_k]
            kept_seqs = {q.seq for q in kept}
            for q in jobs:
                if q.seq not in kept_seqs:
                    # a discarded straggler: never trained, never aggregated, but its client stays busy
                    self._release(self.states[n], q.version)
            plan += sorted(kept, key=lambda q: q.client)
            round_end = max([round_end] + [q.finish_at for q in kept])
        self._plan, self._position, self._round_end = plan, 0, round_end

    def pop(self) -> Request | None:
        for _ in range(MAX_WAIT):
            if self.done:
                return None
            if self._plan is None:
                self._plan_round()
            if self._position < len(self._plan):
                request = self._plan[self._position]
                self._position += 1
                request = replace(request, closes=self._position == len(self._plan))
                self._open[request.seq] = request
                self.states[request.task].meta.append((request.seq, request.client, 0))
                self.states[request.task].count += 1
                return request
            self._close_round()  # nobody was kept this round
        raise RuntimeError(f"no client was available in {MAX_WAIT} consecutive Sync-ST rounds")

    def submit(self, request: Request, delta: Tensor, loss: float = float("nan")) -> list[dict]:
        request = self._take_open(request)
        st = self.states[request.task]
        self._release(st, request.version)
        if st.finished:
            return []
        self._add(st, request, delta, loss)
        return self._close_round() if request.closes else []

    def _close_round(self) -> list[dict]:
        self.clock = self._round_end
        records = []
        for n in self.active_tasks:
            st = self.states[n]
            if st.count == 0:
                continue
            self._step(st, self.rule.server_lr)
            records.append(self._record(n, st, R=self._assigned.get(n, 0), b=st.count, sync_round=self.sync_round))
            st.reset_buffer()
        self.sync_round += 1
        self._plan = None
        return records

    def stop_task(self, task: str) -> None:
        """Stop ``task``; from the next round its share of the clients goes to the others (∝ their weights)."""
        st = self._state(task)
        if st.finished:
            return
        st.finished, st.finish_time = True, self.clock
        if self._plan is not None:
            for request in self._plan[self._position:]:
                if request.task == task:
                    self._release(st, request.version)
            self._plan = self._plan[: self._position] + [q for q in self._plan[self._position:] if q.task != task]
        st.reset_buffer()

    def state_dict(self) -> dict:
        return {
            **super().state_dict(), "sync_round": self.sync_round,
            "plan": None if self._plan is None else [asdict(q) for q in self._plan],
            "assigned": dict(self._assigned), "round_end": self._round_end, "position": self._position,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sync_round = int(state["sync_round"])
        self._plan = None if state["plan"] is None else [Request(**q) for q in state["plan"]]
        self._assigned = {k: int(v) for k, v in state["assigned"].items()}
        self._round_end = float(state["round_end"])
        self._position = int(state["position"])
