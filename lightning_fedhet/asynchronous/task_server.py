"""TaskServer: what the FedAST and Sync-ST servers share (the tasks' models and versions, client queues, the clock).

Framework-free: a server never trains. It hands out the requests in the order their updates reach it and takes
back each request's delta ``w_local - w_sent``; whoever drives it (the Lightning strategy, or
:func:`~lightning_fedhet.asynchronous.driver.run` with any local solver) does the local training in between::

    server = FedAST(requests=4, buffer=2).build({"a": Task(x0, local_steps=5, latency=1.0)}, num_clients=100)
    while (request := server.pop()) is not None:
        w_sent = server.sent_params(request)          # the model version the request carried, [d]
        w_local = my_local_training(request, w_sent)  # request.local_steps steps on request.client's data
        server.submit(request, w_local - w_sent)      # may take a server step (see server.history)

Simulated time is in seconds. Each request goes to a client chosen by the server's client pool
(:mod:`~lightning_fedhet.asynchronous.pool`), waits for the requests queued before it on that client (first come,
first served: ``starts_at = max(sent_at, client busy until)``), then takes its duration from the task's latency
model (:mod:`~lightning_fedhet.asynchronous.latency`); it reaches the server at ``finish_at``. Every random draw is
counter-based: request ``seq`` draws its duration from ``generator(seed, Stream.REQUEST_LATENCY, seq)``, so a
resumed server (:meth:`TaskServer.state_dict`) continues exactly as an uninterrupted one.

Two-phase arrivals. :meth:`pop` does everything that does not depend on the update's value (the clock, the buffer
count, staleness, and, for an arrival that does not close a server step, the new requests); :meth:`submit` adds
the value and, for the arrival marked ``request.closes``, takes the server step. A driver may therefore pop the
next request before submitting the previous one unless the previous one ``closes`` (Lightning prefetches one batch
ahead). Model tensors are never modified in place: a reference to ``params(task)`` stays the model of that moment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet.asynchronous.latency import request_duration
from lightning_fedhet.asynchronous.pool import CappedPool, ClientPool
from lightning_fedhet.asynchronous.task import Request, Task, TaskState
from lightning_fedhet.flat import all_finite
from lightning_fedhet.seeding import Stream, generator


class TaskServer:
    """What both servers share: the tasks' models and versions, the client queues, the clock and the history.

    Args:
        tasks: name -> :class:`Task`.
        num_clients: ``N >= 1``.
        pool: the client pool (default: the paper's ``CappedPool(0.3)``); set up here with ``(N, seed)``.
        seed: seed of every draw.

    Attributes:
        names: the task names, in order.
        clock: simulated seconds (the time of the last arrival, or the end of the last Sync-ST round).
        history: one dict per server step (see :class:`~.fedast_server.FedASTServer` /
            :class:`~.syncst_server.SyncSTServer`).
        rejected_total: updates rejected as non-finite so far (dropped; the model is untouched).
    """

    def __init__(self, tasks: Mapping[str, Task], num_clients: int, pool: ClientPool | None = None,
                 seed: int = 0) -> None:
        if not isinstance(tasks, Mapping) or not tasks:
            raise ValueError("tasks must be a non-empty mapping name -> Task")
        if isinstance(num_clients, bool) or int(num_clients) != num_clients or int(num_clients) < 1:
            raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
        if isinstance(seed, bool) or int(seed) != seed or int(seed) < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if pool is not None and not isinstance(pool, ClientPool):
            raise TypeError(f"pool must be a ClientPool (CappedPool, AvailabilityPool), got {type(pool).__name__}")
        self.names = [str(n) for n in tasks]
        self.num_clients = int(num_clients)
        self.seed = int(seed)
        self.pool = pool if pool is not None else CappedPool()
        self.pool.setup(self.num_clients, self.seed)
        self.states = {str(n): TaskState(spec, str(n)) for n, spec in tasks.items()}
        for st in self.states.values():
            st.latency.setup(self.num_clients, self.seed)
        self.clock = 0.0
        self.next_seq = 0
        self.busy = np.zeros(self.num_clients, dtype=np.float64)
        self.history: list[dict] = []
        self.rejected_total = 0
        self._open: dict[int, Request] = {}

    # ------------------------------------------------------------------ public state
    def params(self, task: str) -> Tensor:
        """The current global parameters of ``task``, flat ``[d]`` (do not modify in place)."""
        return self._state(task).params

    def sent_params(self, request: Request) -> Tensor:
        """The model version ``request`` carried, flat ``[d]`` (kept until the request is submitted)."""
        return self._state(request.task).versions[request.version]

    def round(self, task: str) -> int:
        """Server steps ``task`` has taken so far (``t_m``)."""
        return self._state(task).round

    @property
    def active_tasks(self) -> list[str]:
        """Tasks still training, in order."""
        return [n for n in self.names if not self.states[n].finished]

    @property
    def done(self) -> bool:
        return not self.active_tasks

    @property
    def finish_times(self) -> dict[str, float | None]:
        """Simulated seconds at which each stopped task was stopped (None while it trains)."""
        return {n: self.states[n].finish_time for n in self.names}

    @property
    def open_requests(self) -> list[Request]:
        """Requests popped but not yet submitted."""
        return list(self._open.values())

    # ------------------------------------------------------------------ protocol
    def pop(self) -> Request | None:
        """The next update to reach the server (None when every task has stopped); see the module doc."""
        raise NotImplementedError

    def submit(self, request: Request, delta: Tensor, loss: float = float("nan")) -> list[dict]:
        """Hand back ``delta = w_local - w_sent`` of a popped request; returns the server steps it caused."""
        raise NotImplementedError

    def stop_task(self, task: str) -> None:
        """Stop training ``task`` now (e.g. it reached its target accuracy); its requests go to the others."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared machinery
    def _state(self, task: str) -> TaskState:
        if task not in self.states:
            raise KeyError(f"unknown task {task!r}; the tasks are {self.names}")
        return self.states[task]

    def _make_request(self, task: str, client: int, sent_at: float, data_key: int | None) -> Request:
        """Send one request of ``task`` to ``client`` at ``sent_at``, carrying the task's current model; it joins
        the client's queue (first come, first served)."""
        st = self.states[task]
        seq = self.next_seq
        self.next_seq += 1
        duration = request_duration(st.latency, client, st.local_steps,
                                    generator(self.seed, Stream.REQUEST_LATENCY, seq))
        starts_at = max(sent_at, float(self.busy[client]))
        finish_at = starts_at + duration
        self.busy[client] = finish_at
        st.versions.setdefault(st.round, st.params)
        st.refs[st.round] = st.refs.get(st.round, 0) + 1
        return Request(seq, task, int(client), st.round, sent_at, starts_at, finish_at, st.local_steps,
                       seq if data_key is None else int(data_key))

    def _release(self, st: TaskState, version: int) -> None:
        """A request carrying ``version`` is done; drop the version once no request uses it."""
        st.refs[version] -= 1
        if st.refs[version] == 0:
            del st.refs[version]
            del st.versions[version]

    def _take_open(self, request: Request) -> Request:
        if request.seq not in self._open:
            raise ValueError(f"request {request.seq} was not popped, or was submitted already")
        return self._open.pop(request.seq)

    def _add(self, st: TaskState, request: Request, delta: Tensor, loss: float) -> bool:
        """Streams one update into the task's buffer; a non-finite one is rejected and counted."""
        if delta.shape != st.params.shape:
            raise ValueError(f"delta of task {request.task!r} must have shape {tuple(st.params.shape)}, "
                             f"got {tuple(delta.shape)}")
        if not all_finite(delta):
            st.rejected.append(request.seq)
            self.rejected_total += 1
            return False
        delta = delta.to(st.params)
        st.sum = delta.clone() if st.sum is None else st.sum.add_(delta)
        st.valid += 1
        st.losses.append(float(loss))
        return True

    def _step(self, st: TaskState, server_lr: float) -> None:
        """``x <- x + eta_s * (1/|B|) sum_B (w_local - w_sent)`` (eq. 9; stale updates as they are)."""
        if st.valid > 0:
            # new tensor, never in place: model versions still referenced by requests keep their values
            st.params = st.params + (server_lr / st.valid) * st.sum
        st.round += 1

    def _record(self, task: str, st: TaskState, **extra: Any) -> dict:
        losses = [x for x in st.losses if math.isfinite(x)]
        record = {
            "task": task,
            "round": st.round,
            "sim_time": self.clock,
            "requests": [m[0] for m in st.meta],
            "clients": [m[1] for m in st.meta],
            "staleness": [m[2] for m in st.meta],
            "rejected": list(st.rejected),
            "loss": float(np.mean(losses)) if losses else None,
            **extra,
        }
        self.history.append(record)
        return record

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: models, pending requests, queues, buffers, history."""
        return {
            "clock": self.clock, "next_seq": self.next_seq, "busy": torch.from_numpy(self.busy.copy()),
            "history": [dict(h) for h in self.history], "rejected_total": self.rejected_total,
            "open": [asdict(r) for r in self._open.values()],
            "tasks": {n: self.states[n].state_dict() for n in self.names},
        }

    def load_state_dict(self, state: dict) -> None:
        if list(state["tasks"]) != self.names:
            raise ValueError(f"the state holds tasks {list(state['tasks'])}, this server has {self.names}")
        self.clock = float(state["clock"])
        self.next_seq = int(state["next_seq"])
        self.busy = state["busy"].numpy().astype(np.float64).copy()
        self.history = [dict(h) for h in state["history"]]
        self.rejected_total = int(state["rejected_total"])
        self._open = {int(r["seq"]): Request(**r) for r in state["open"]}
        for n in self.names:
            self.states[n].load_state_dict(state["tasks"][n])
        self.pool.setup(self.num_clients, self.seed)  # drops any cache of the pool
