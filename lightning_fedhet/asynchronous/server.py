"""Event-driven servers that train several models (tasks) on one client pool, on a virtual clock.

Framework-free: a server never trains. It hands out the requests in the order their updates reach it and
takes back each request's delta ``w_local - w_sent``; whoever drives it (the Lightning strategy, or
:func:`run` with any local solver) does the local training in between::

    server = FedAST(requests=4, buffer=2).build({"a": Task(x0, local_steps=5, latency=1.0)}, num_clients=100)
    while (request := server.pop()) is not None:
        w_sent = server.sent_params(request)          # the model version the request carried, [d]
        w_local = my_local_training(request, w_sent)  # request.local_steps steps on request.client's data
        server.submit(request, w_local - w_sent)      # may take a server step (see server.history)

Simulated time is in seconds. Each request goes to a client, waits for the requests queued before it on that
client (first come, first served: ``starts_at = max(sent_at, client busy until)``), then takes its duration from
the task's latency model (:mod:`~lightning_fedhet.asynchronous.latency`); it reaches the server at
``finish_at``. Requests are popped by ``(finish_at, seq)``: simultaneous arrivals come in the order the requests
were sent. Every random draw is counter-based: request ``seq`` draws its client from
``generator(seed, Stream.REQUEST_CLIENT, seq)`` and its duration from ``generator(seed, Stream.REQUEST_LATENCY,
seq)``, so a resumed server (:meth:`TaskServer.state_dict`) continues exactly as an uninterrupted one.

Availability: the pool of clients that accept a new request at time ``T`` is ``participation.sample(floor(T /
slot))`` (Sync-ST: ``participation.sample(round)``). If nobody is available, the request waits for the start of
the next slot with an available client (sent then, with the model it was created with).

Two-phase arrivals. :meth:`pop` does everything that does not depend on the update's value (the clock, the
buffer count, staleness, and, for an arrival that does not fill a buffer, Algorithm 2 line 13's new requests);
:meth:`submit` adds the value and, for the arrival marked ``request.closes``, runs the reallocation, the server
step and line 13 (so new requests carry the updated model). A driver may therefore pop the next request before
submitting the previous one unless the previous one ``closes`` (Lightning prefetches one batch ahead).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet.asynchronous.latency import as_request_latency, request_duration
from lightning_fedhet.asynchronous.rules import (
    FedAST,
    SyncST,
    allocation_scores,
    normalized_variance,
    resolve_per_task,
    split_budget,
)
from lightning_fedhet.flat import all_finite
from lightning_fedhet.participation.full import Full
from lightning_fedhet.participation.uniform import UniformSample
from lightning_fedhet.seeding import Stream, generator

#: How many empty availability slots (or empty Sync-ST rounds) a request waits before the run is declared stuck.
MAX_WAIT = 100_000


@dataclass(frozen=True)
class Task:
    """One model trained by the federation.

    Args:
        params: initial global parameters, a flat floating tensor ``[d]``
            (e.g. ``lightning_fedhet.flat.FlatModel(module).get()``).
        local_steps: ``tau_m >= 1``, local SGD steps per request.
        latency: request duration model: seconds (a constant), a :class:`~.latency.Constant` or a
            :class:`~lightning_fedhet.system.ShiftedExponential` (set up by the server with its seed).
        client_lr: ``eta_c > 0``; only the dynamic allocation's scaling (Algorithm 4 line 3) reads it.
    """

    params: Tensor
    local_steps: int = 1
    latency: Any = 1.0
    client_lr: float = 1.0


@dataclass(frozen=True)
class Request:
    """One local-training request (times in simulated seconds).

    Attributes:
        seq: global send order, 0-based (unique; keys the request's random draws).
        task: the task's name.
        client: the client id that runs it.
        version: the task's round index ``t_m`` of the model it carries.
        sent_at: when the server sent it.
        starts_at: when the client starts it (after the requests queued before it on that client).
        finish_at: when its update reaches the server.
        local_steps: ``tau_m``.
        data_key: the ``round`` key of the client's mini-batch stream
            (:meth:`~lightning_fedhet.data.streams.ClientStreams.batch_indices`): ``seq`` for FedAST, the round
            for Sync-ST.
        closes: set by :meth:`TaskServer.pop`: submitting this update ends a server step (a full buffer, a
            reallocation, or the end of a Sync-ST round).
    """

    seq: int
    task: str
    client: int
    version: int
    sent_at: float
    starts_at: float
    finish_at: float
    local_steps: int
    data_key: int
    closes: bool = False


class _TaskState:
    """Everything the server keeps about one task (internal)."""

    def __init__(self, spec: Task, name: str) -> None:
        if not isinstance(spec, Task):
            raise TypeError(f"tasks[{name!r}] must be a Task, got {type(spec).__name__}")
        params = spec.params
        if not isinstance(params, Tensor) or params.dim() != 1 or not torch.is_floating_point(params):
            raise ValueError(f"tasks[{name!r}].params must be a flat floating tensor [d]")
        if isinstance(spec.local_steps, bool) or int(spec.local_steps) != spec.local_steps or spec.local_steps < 1:
            raise ValueError(f"tasks[{name!r}].local_steps must be an integer >= 1, got {spec.local_steps!r}")
        if not (math.isfinite(float(spec.client_lr)) and float(spec.client_lr) > 0):
            raise ValueError(f"tasks[{name!r}].client_lr must be a finite number > 0, got {spec.client_lr!r}")
        self.params = params.detach().clone()
        self.local_steps = int(spec.local_steps)
        self.client_lr = float(spec.client_lr)
        self.latency = as_request_latency(spec.latency, f"tasks[{name!r}].latency")
        self.round = 0
        self.versions: dict[int, Tensor] = {}
        self.refs: dict[int, int] = {}
        self.finished = False
        self.finish_time: float | None = None
        # the open buffer (FedAST) or the round's kept updates (Sync-ST)
        self.sum: Tensor | None = None
        self.count = 0
        self.valid = 0
        self.meta: list[tuple[int, int, int]] = []  # (seq, client, staleness) per received update
        self.rejected: list[int] = []
        self.losses: list[float] = []
        # FedAST only
        self.R = 0
        self.b = 1
        self.ratio = 1.0
        self.in_flight = 0
        self.seen = 0
        self.window: deque[Tensor] = deque()

    def reset_buffer(self) -> None:
        self.sum, self.count, self.valid = None, 0, 0
        self.meta, self.rejected, self.losses = [], [], []

    def state_dict(self) -> dict:
        return {
            "params": self.params, "round": self.round, "versions": dict(self.versions), "refs": dict(self.refs),
            "finished": self.finished, "finish_time": self.finish_time, "sum": self.sum, "count": self.count,
            "valid": self.valid, "meta": list(self.meta), "rejected": list(self.rejected),
            "losses": list(self.losses), "R": self.R, "b": self.b, "ratio": self.ratio,
            "in_flight": self.in_flight, "seen": self.seen, "window": list(self.window),
        }

    def load_state_dict(self, state: dict) -> None:
        self.params = state["params"]
        self.round = int(state["round"])
        self.versions = {int(k): v for k, v in state["versions"].items()}
        self.refs = {int(k): int(v) for k, v in state["refs"].items()}
        self.finished = bool(state["finished"])
        self.finish_time = state["finish_time"]
        self.sum = state["sum"]
        self.count, self.valid = int(state["count"]), int(state["valid"])
        self.meta = [tuple(m) for m in state["meta"]]
        self.rejected = list(state["rejected"])
        self.losses = list(state["losses"])
        self.R, self.b, self.ratio = int(state["R"]), int(state["b"]), float(state["ratio"])
        self.in_flight, self.seen = int(state["in_flight"]), int(state["seen"])
        self.window = deque(state["window"])


class TaskServer:
    """What both servers share: the tasks' models and versions, the client queues, the clock and the history.

    Attributes:
        names: the task names, in order.
        clock: simulated seconds (the time of the last arrival, or the end of the last Sync-ST round).
        history: one dict per server step (see :class:`FedASTServer` / :class:`SyncSTServer`).
        rejected_total: updates rejected as non-finite so far (dropped; the model is untouched).
    """

    def __init__(self, tasks: Mapping[str, Task], num_clients: int, participation: Any = None, slot: float = 1.0,
                 seed: int = 0) -> None:
        if not isinstance(tasks, Mapping) or not tasks:
            raise ValueError("tasks must be a non-empty mapping name -> Task")
        if isinstance(num_clients, bool) or int(num_clients) != num_clients or int(num_clients) < 1:
            raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
        if not (math.isfinite(float(slot)) and float(slot) > 0):
            raise ValueError(f"slot must be a finite number of seconds > 0, got {slot!r}")
        if isinstance(seed, bool) or int(seed) != seed or int(seed) < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.names = [str(n) for n in tasks]
        self.num_clients = int(num_clients)
        self.slot = float(slot)
        self.seed = int(seed)
        self.participation = participation if participation is not None else Full()
        self.participation.setup(self.num_clients, self.seed)
        self.states = {str(n): _TaskState(spec, str(n)) for n, spec in tasks.items()}
        for st in self.states.values():
            st.latency.setup(self.num_clients, self.seed)
        self.clock = 0.0
        self.next_seq = 0
        self.busy = np.zeros(self.num_clients, dtype=np.float64)
        self.history: list[dict] = []
        self.rejected_total = 0
        self._open: dict[int, Request] = {}
        self._pool_cache: tuple[int, np.ndarray] | None = None

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
    def _state(self, task: str) -> _TaskState:
        if task not in self.states:
            raise KeyError(f"unknown task {task!r}; the tasks are {self.names}")
        return self.states[task]

    def _pool(self, slot: int) -> np.ndarray:
        if self._pool_cache is None or self._pool_cache[0] != slot:
            mask = self.participation.sample(slot)
            self._pool_cache = (slot, np.flatnonzero(mask.numpy() if isinstance(mask, Tensor) else mask))
        return self._pool_cache[1]

    def _available_at(self, time: float) -> tuple[np.ndarray, float]:
        """The available clients at ``time``, or at the start of the first later slot that has some."""
        first = int(time // self.slot)
        for slot in range(first, first + MAX_WAIT):
            ids = self._pool(slot)
            if ids.size:
                return ids, (time if slot == first else slot * self.slot)
        raise RuntimeError(f"no client was available in {MAX_WAIT} slots of {self.slot:g} s after t={time:g} s")

    def _make_request(self, task: str, client: int | None, data_key: int | None) -> Request:
        """Send one request of ``task`` now, carrying its current model; ``client=None``: a uniform draw from
        the available pool (with replacement across requests)."""
        st = self.states[task]
        seq = self.next_seq
        self.next_seq += 1
        sent_at = self.clock
        if client is None:
            pool, sent_at = self._available_at(self.clock)
            client = int(pool[generator(self.seed, Stream.REQUEST_CLIENT, seq).integers(pool.size)])
        duration = request_duration(st.latency, client, st.local_steps,
                                    generator(self.seed, Stream.REQUEST_LATENCY, seq))
        starts_at = max(sent_at, float(self.busy[client]))  # first come, first served on each client
        finish_at = starts_at + duration
        self.busy[client] = finish_at
        st.versions.setdefault(st.round, st.params)
        st.refs[st.round] = st.refs.get(st.round, 0) + 1
        return Request(seq, task, int(client), st.round, sent_at, starts_at, finish_at, st.local_steps,
                       seq if data_key is None else int(data_key))

    def _release(self, st: _TaskState, version: int) -> None:
        """A request carrying ``version`` is done; drop the version once no request uses it."""
        st.refs[version] -= 1
        if st.refs[version] == 0:
            del st.refs[version]
            del st.versions[version]

    def _take_open(self, request: Request) -> Request:
        if request.seq not in self._open:
            raise ValueError(f"request {request.seq} was not popped, or was submitted already")
        return self._open.pop(request.seq)

    def _add(self, st: _TaskState, request: Request, delta: Tensor, loss: float) -> bool:
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

    def _step(self, st: _TaskState, server_lr: float) -> None:
        """``x <- x + eta_s * (1/|B|) sum_B (w_local - w_sent)`` (eq. 9; stale updates as they are)."""
        if st.valid > 0:
            # new tensor, never in place: model versions still referenced by requests keep their values
            st.params = st.params + (server_lr / st.valid) * st.sum
        st.round += 1

    def _record(self, task: str, st: _TaskState, **extra: Any) -> dict:
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
        self._pool_cache = None


class FedASTServer(TaskServer):
    """FedAST (paper Algorithm 2, option S or D) on a virtual clock. Built by :meth:`FedAST.build`.

    At construction every task sends its ``R_m`` first requests (line 4), task after task. Then, per arrival of
    a task-``m`` update (lines 6-13): it joins ``B_m`` and the update counter ``c`` grows (line 7); in option D
    a reallocation runs when ``period * M * sum R`` updates arrived since the last one and every task has ``V``
    updates (line 8, Algorithms 3-4); if ``|B_m| >= b_m`` the server steps (lines 9-11, eq. 9); then ``K_m`` new
    requests carry the current model (line 13): ``K_m = 1`` (S) or ``clip(R_m - in_flight_m, 0, max_new)`` (D,
    the gradual transition of §3).

    ``history`` holds one dict per server step: ``task``, ``round`` (``t_m`` after the step), ``sim_time``
    (seconds), ``requests``/``clients``/``staleness`` (one entry per update in the buffer, arrival order;
    staleness = the task's server steps between sending and receiving), ``rejected``, ``loss`` (mean training
    loss reported with the updates), ``R``, ``b``, ``in_flight`` (task-``m`` requests still out) and
    ``updates`` (the counter ``c``). ``reallocations`` holds one dict per run of Algorithm 3.
    """

    def __init__(self, rule: FedAST, tasks: Mapping[str, Task], num_clients: int, participation: Any = None,
                 slot: float = 1.0, seed: int = 0) -> None:
        if not isinstance(rule, FedAST):
            raise TypeError(f"rule must be a FedAST, got {type(rule).__name__}")
        super().__init__(tasks, num_clients, participation, slot, seed)
        self.rule = rule
        requests = resolve_per_task(rule.requests, self.names, "requests")
        buffers = resolve_per_task(rule.buffer, self.names, "buffer")
        for n in self.names:
            if requests[n] % rule.quantum:
                raise ValueError(f"requests[{n!r}]={requests[n]} must be a multiple of quantum={rule.quantum}")
            st = self.states[n]
            st.R, st.b = requests[n], buffers[n]
            st.ratio = requests[n] / buffers[n]  # R_m / b_m, kept by every reallocation (Algorithm 3 line 4)
            st.window = deque(maxlen=rule.window)
        self.updates = 0
        self.since_realloc = 0
        self.reallocations: list[dict] = []
        self._realloc_due = False
        self._heap: list[tuple[float, int, Request]] = []
        for n in self.names:  # line 4
            for _ in range(self.states[n].R):
                self._send(n)

    def _send(self, task: str) -> None:
        request = self._make_request(task, client=None, data_key=None)
        heapq.heappush(self._heap, (request.finish_at, request.seq, request))
        self.states[task].in_flight += 1

    def _period(self) -> int:
        active = self.active_tasks
        return max(1, math.ceil(self.rule.period * len(active) * sum(self.states[n].R for n in active)))

    def pop(self) -> Request | None:
        if not self._heap:
            return None
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

    def _send_new(self, task: str) -> None:
        st = self.states[task]
        k = 1 if self.rule.option == "S" else min(max(st.R - st.in_flight, 0), self.rule.max_new)
        for _ in range(k):
            self._send(task)

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
        new = split_budget(total, scores, self.rule.quantum)
        for n in active:
            st = self.states[n]
            st.R = new[n]
            st.b = max(1, math.floor(st.R / st.ratio + 0.5))
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
        extra = split_budget(freed, {n: self.states[n].R for n in active}, self.rule.quantum, minimum=0)
        for n in active:
            other = self.states[n]
            other.R += extra[n]
            other.b = max(1, math.floor(other.R / other.ratio + 0.5))
            if self.rule.option == "S":
                for _ in range(max(other.R - other.in_flight, 0)):
                    self._send(n)

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "updates": self.updates, "since_realloc": self.since_realloc, "realloc_due": self._realloc_due,
            "reallocations": [dict(r) for r in self.reallocations],
            "pending": [asdict(e[2]) for e in self._heap],
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.updates = int(state["updates"])
        self.since_realloc = int(state["since_realloc"])
        self._realloc_due = bool(state["realloc_due"])
        self.reallocations = [dict(r) for r in state["reallocations"]]
        self._heap = [(r["finish_at"], r["seq"], Request(**r)) for r in state["pending"]]
        heapq.heapify(self._heap)
        for n in self.names:
            if self.states[n].window.maxlen != self.rule.window:
                self.states[n].window = deque(self.states[n].window, maxlen=self.rule.window)


class SyncSTServer(TaskServer):
    """Sync-ST (see :class:`~.rules.SyncST`) on the virtual clock. Built by :meth:`SyncST.build`.

    The kept requests of a round are handed out task after task, each task's in client-id order (a synchronous
    server aggregates at the round's end, so the order only fixes the summation order; it is FedAvg's). The last
    one ``closes`` the round: every task with kept updates steps, and the clock jumps to the round's end (the
    last kept arrival over all tasks). Discarded stragglers are never trained (their work is wasted) but keep
    their client busy. Each request's data key is the round.

    ``history`` holds one dict per task per round: ``task``, ``round`` (``t_m`` after the step), ``sim_time``,
    ``requests``/``clients``/``staleness`` (0) of the kept updates, ``rejected``, ``loss``, ``R`` (clients
    assigned to the task), ``b`` (updates kept), ``sync_round``.
    """

    def __init__(self, rule: SyncST, tasks: Mapping[str, Task], num_clients: int, participation: Any = None,
                 seed: int = 0) -> None:
        if not isinstance(rule, SyncST):
            raise TypeError(f"rule must be a SyncST, got {type(rule).__name__}")
        super().__init__(tasks, num_clients, participation, 1.0, seed)
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
        available = self.participation.sample(r).numpy()
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
            jobs = [self._make_request(n, int(c), data_key=r) for c in clients]
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


def run(server: TaskServer, local_update: Callable[[Request, Tensor], Tensor], max_steps: int | None = None,
        until: float | None = None) -> list[dict]:
    """Drive ``server`` with a plain local solver until it is done, ``max_steps`` server steps were taken, or
    the clock passed ``until`` seconds.

    Args:
        server: a built server.
        local_update: ``(request, w_sent) -> w_local``, the parameters after ``request.local_steps`` local
            steps of ``request.client`` on ``request.task`` from ``w_sent`` (must not modify ``w_sent``).
        max_steps: stop after this many server steps (records) in this call.
        until: stop once the clock passes this many simulated seconds.

    Returns:
        the server-step records made during this call (also appended to ``server.history``).
    """
    records: list[dict] = []
    while (max_steps is None or len(records) < max_steps) and (until is None or server.clock <= until):
        request = server.pop()
        if request is None:
            break
        sent = server.sent_params(request)
        records += server.submit(request, local_update(request, sent) - sent)
    return records
