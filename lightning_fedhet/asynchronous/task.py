"""What the asynchronous servers exchange with their driver and keep per task: :class:`Task` (a model to train),
:class:`Request` (one local-training request, times in simulated seconds) and the per-task server state."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fedhet.asynchronous.latency import as_request_latency


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


class TaskState:
    """Everything a server keeps about one task (internal to the servers; not exported)."""

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
