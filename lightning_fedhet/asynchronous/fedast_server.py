"""FedASTServer: FedAST (paper Algorithm 2, option S or D) on a virtual clock, built by ``FedAST(...).build``."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_fedhet.asynchronous.allocation import (
    allocation_scores,
    normalized_variance,
    resolve_per_task,
    split_budget,
)
from lightning_fedhet.asynchronous.pool import ClientPool
from lightning_fedhet.asynchronous.task import Request, Task, TaskState
from lightning_fedhet.asynchronous.task_server import TaskServer


class FedASTSettings(Protocol):
    """What the server reads from its rule (:class:`~lightning_fedhet.asynchronous.FedAST` validates them)."""

    option: str
    requests: int | Mapping[str, int]
    buffer: int | Mapping[str, int]
    server_lr: float
    window: int
    period: float
    allocation: str
    quantum: int | None
    max_new: int


class FedASTServer(TaskServer):
    """FedAST (paper Algorithm 2, option S or D) on a virtual clock. Built by :meth:`FedAST.build`.

    At construction every task sends its ``R_m`` first requests (line 4), task after task. Then, per arrival of
    a task-``m`` update (lines 6-13): it joins ``B_m`` and the update counter ``c`` grows (line 7); in option D
    a reallocation runs when ``period * M * sum R`` updates arrived since the last one and every task has ``V``
    updates (line 8, Algorithms 3-4); if ``|B_m| >= b_m`` the server steps (lines 9-11, eq. 9); then new requests
    carry the current model (line 13): ``K_m = clip(R_m - in_flight_m, 0, max_new)``. That is ``K_m = 1`` in
    option S whenever no request was skipped, and the gradual transition of §3 in option D; a request the client
    pool skipped (:class:`~.pool.CappedPool`: the cap on busy clients was reached) is made up this way at the
    task's next arrival, as in the authors' code. A task left with no request in flight (all skipped) is topped
    up at the next arrival of any task, so it cannot starve.

    Option D holds ``R_m / b_m`` fixed exactly (Algorithm 3 line 4): the ratio must be the same integer ``r`` for
    every task, and the budget is re-split in multiples of ``quantum`` (default ``r``; the authors' code: 32 =
    its ``R/b``), so ``b_m = R_m / r`` and a small ``R_m`` never leaves a buffer of 1 with a larger ratio.

    ``history`` holds one dict per server step: ``task``, ``round`` (``t_m`` after the step), ``sim_time``
    (seconds), ``requests``/``clients``/``staleness`` (one entry per update in the buffer, arrival order;
    staleness = the task's server steps between sending and receiving), ``rejected``, ``loss`` (mean training
    loss reported with the updates), ``R``, ``b``, ``in_flight`` (task-``m`` requests still out) and
    ``updates`` (the counter ``c``). ``reallocations`` holds one dict per run of Algorithm 3; ``skipped`` counts
    the skipped requests per task.
    """

    def __init__(self, rule: FedASTSettings, tasks: Mapping[str, Task], num_clients: int,
                 pool: ClientPool | None = None, seed: int = 0) -> None:
        super().__init__(tasks, num_clients, pool, seed)
        self.rule = rule
        requests = resolve_per_task(rule.requests, self.names, "requests")
        buffers = resolve_per_task(rule.buffer, self.names, "buffer")
        ratios = {n: requests[n] / buffers[n] for n in self.names}
        if rule.option == "D":
            r = ratios[self.names[0]]
            if any(v != r for v in ratios.values()) or r != int(r):
                raise ValueError(f"option D keeps R_m / b_m fixed, so requests / buffer must be the same integer for "
                                 f"every task; got {ratios}")
            self.quantum = int(r) if rule.quantum is None else int(rule.quantum)
            if self.quantum % int(r):
                raise ValueError(f"quantum={self.quantum} must be a multiple of R_m / b_m = {int(r)} in option D")
        else:
            self.quantum = 1 if rule.quantum is None else int(rule.quantum)
        for n in self.names:
            if requests[n] % self.quantum:
                raise ValueError(f"requests[{n!r}]={requests[n]} must be a multiple of quantum={self.quantum}")
            st = self.states[n]
            st.R, st.b = requests[n], buffers[n]
            st.ratio = ratios[n]  # R_m / b_m, kept by every reallocation (Algorithm 3 line 4)
            st.window = deque(maxlen=rule.window)
        self.updates = 0
        self.since_realloc = 0
        self.draws = 0
        self.skipped = {n: 0 for n in self.names}
        self.reallocations: list[dict] = []
        self._realloc_due = False
        self._heap: list[tuple[float, int, Request]] = []
        for n in self.names:  # line 4
            for _ in range(self.states[n].R):
                self._send(n)

    def _send(self, task: str) -> bool:
        """One request of ``task`` to the pool's client; False when the pool skipped it."""
        client, sent_at = self.pool.assign(self.clock, self.busy, self.draws)
        self.draws += 1
        if client is None:
            self.skipped[task] += 1
            return False
        request = self._make_request(task, client, sent_at, data_key=None)
        heapq.heappush(self._heap, (request.finish_at, request.seq, request))
        self.states[task].in_flight += 1
        return True

    def _top_up(self, task: str) -> None:
        st = self.states[task]
        for _ in range(min(max(st.R - st.in_flight, 0), self.rule.max_new)):
            self._send(task)

    def _send_new(self, task: str) -> None:
        """Line 13 for ``task``, then any other task left with nothing in flight (every request skipped)."""
        self._top_up(task)
        for n in self.active_tasks:
            if n != task and self.states[n].in_flight == 0:
                self._top_up(n)

    def _buffer(self, st: TaskState) -> int:
        if self.rule.option == "D":
            return st.R // int(st.ratio)  # exact: R_m is a multiple of quantum, a multiple of the ratio
        return max(1, math.floor(st.R / st.ratio + 0.5))

    def _period(self) -> int:
        active = self.active_tasks
        return max(1, math.ceil(self.rule.period * len(active) * sum(self.states[n].R for n in active)))

    def pop(self) -> Request | None:
        while not self._heap:  # every request was skipped: wait for the next busy client to free up
            later = self.busy[self.busy > self.clock]
            if self.done or later.size == 0:
                return None
            self.clock = float(later.min())
            for n in self.active_tasks:
                self._top_up(n)
        _, _, request = heapq.heappop(self._heap)
        st = self.states[request.task]
        self.clock = request.finish_at
        st.in_flight -= 1
        st.count += 1  # line 7: B_m <- B_m + {Delta}, c <- c + 1
        st.seen += 1
        st.meta.append((request.seq, request.client, st.round - request.version))
        self.updates += 1
        self.since_realloc += 1
        if (self.rule.option == "D" and self.since_realloc >= self._period()
                and all(self.states[n].seen >= self.rule.window for n in self.active_tasks)):
            self._realloc_due = True
        closes = self._realloc_due or st.count >= st.b
        request = replace(request, closes=closes)
        self._open[request.seq] = request
        if not closes:
            self._send_new(request.task)  # line 13; no server step can happen on this arrival
        return request

    def submit(self, request: Request, delta: Tensor, loss: float = float("nan")) -> list[dict]:
        request = self._take_open(request)
        st = self.states[request.task]
        self._release(st, request.version)
        if st.finished:
            return []
        if self._add(st, request, delta, loss) and self.rule.option == "D":
            st.window.append(delta.detach().to("cpu", torch.float32, copy=True))
        if not request.closes:
            return []
        if self._realloc_due:  # line 8
            self._realloc_due = False
            self._reallocate()
        records = []
        if st.count >= st.b:  # lines 9-11
            self._step(st, self.rule.server_lr)
            records.append(self._record(request.task, st, R=st.R, b=st.b, in_flight=st.in_flight,
                                        updates=self.updates))
            st.reset_buffer()
        self._send_new(request.task)  # line 13, with the model after a possible step
        return records

    def _reallocate(self) -> None:
        """Algorithm 3 (option D): ``R_m ∝ sigma_hat_m`` with ``sum R`` fixed, ``R_m / b_m`` fixed."""
        self.since_realloc = 0
        active = self.active_tasks
        record: dict[str, Any] = {"sim_time": self.clock, "updates": self.updates,
                                  "R_before": {n: self.states[n].R for n in active}}
        if len(active) < 2:
            self.reallocations.append({**record, "skipped": "fewer than two tasks"})
            return
        if any(len(self.states[n].window) < 2 for n in active):
            self.reallocations.append({**record, "skipped": "fewer than two valid updates in a window"})
            return
        variances = {n: normalized_variance(torch.stack(list(self.states[n].window))) for n in active}
        scores = allocation_scores(
            variances, self.rule.allocation, self.rule.server_lr,
            {n: self.states[n].client_lr for n in active}, {n: self.states[n].local_steps for n in active},
        )
        if any(not math.isfinite(s) for s in scores.values()) or sum(scores.values()) <= 0:
            self.reallocations.append({**record, "variance": variances, "skipped": "degenerate variance"})
            return
        total = sum(self.states[n].R for n in active)
        new = split_budget(total, scores, self.quantum)
        for n in active:
            st = self.states[n]
            st.R = new[n]
            st.b = self._buffer(st)
        self.reallocations.append({**record, "variance": variances, "score": scores,
                                   "R": {n: self.states[n].R for n in active},
                                   "b": {n: self.states[n].b for n in active}})

    def stop_task(self, task: str) -> None:
        """Stop ``task``: its pending requests are cancelled (their clients stay busy until the cancelled job's
        finish time, as in the authors' code), its partial buffer is dropped, and its ``R_m`` goes to the other
        tasks in proportion to their ``R`` (``b`` follows the fixed ratio). Option S sends the extra requests
        at once; option D ramps up with at most ``max_new`` per arrival."""
        st = self._state(task)
        if st.finished:
            return
        st.finished, st.finish_time = True, self.clock
        kept = []
        for entry in self._heap:
            if entry[2].task == task:
                self._release(st, entry[2].version)
            else:
                kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept
        st.in_flight = 0
        st.reset_buffer()
        st.window.clear()
        freed, st.R = st.R, 0
        active = self.active_tasks
        if not active:
            return
        extra = split_budget(freed, {n: self.states[n].R for n in active}, self.quantum, minimum=0)
        for n in active:
            other = self.states[n]
            other.R += extra[n]
            other.b = self._buffer(other)
            if self.rule.option == "S":
                for _ in range(max(other.R - other.in_flight, 0)):
                    self._send(n)

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "updates": self.updates, "since_realloc": self.since_realloc, "realloc_due": self._realloc_due,
            "draws": self.draws, "skipped": dict(self.skipped),
            "reallocations": [dict(r) for r in self.reallocations],
            "pending": [asdict(e[2]) for e in self._heap],
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.updates = int(state["updates"])
        self.since_realloc = int(state["since_realloc"])
        self._realloc_due = bool(state["realloc_due"])
        self.draws = int(state["draws"])
        self.skipped = {str(k): int(v) for k, v in state["skipped"].items()}
        self.reallocations = [dict(r) for r in state["reallocations"]]
        self._heap = [(r["finish_at"], r["seq"], Request(**r)) for r in state["pending"]]
        heapq.heapify(self._heap)
        for n in self.names:
            if self.states[n].window.maxlen != self.rule.window:
                self.states[n].window = deque(self.states[n].window, maxlen=self.rule.window)
