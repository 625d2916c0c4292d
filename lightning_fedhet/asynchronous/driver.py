"""Driving a server with a plain local solver: :func:`run`, and :func:`run_on_grid`, which also evaluates every
task on one fixed grid of simulated times (the same for every method) and stops each task at its target.

Why a fixed grid: a method evaluated more often has more chances to be seen crossing a target first, and one
evaluated right after a long synchronous round is credited with a model from later than the evaluation time. On
the grid, the value at time ``g`` is that of the models after every server step taken at or before ``g`` (the
models are piecewise constant between steps), whatever the method.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from torch import Tensor

from lightning_fedhet.asynchronous.task import Request
from lightning_fedhet.asynchronous.task_server import TaskServer


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


def run_on_grid(server: TaskServer, local_update: Callable[[Request, Tensor], Tensor],
                evaluate: Callable[[str, Tensor], float], every: float, horizon: float,
                targets: Mapping[str, float] | None = None) -> dict:
    """Train until ``horizon`` simulated seconds (or every task stopped), evaluating each task at ``every``,
    ``2 * every``, ... seconds.

    Each task is evaluated at grid time ``g`` on the models after every server step taken at or before ``g``
    (a reference to the parameters is kept just before each step; parameters are never modified in place).
    A task whose value reaches ``targets[task]`` at ``g`` is stopped (:meth:`TaskServer.stop_task`, its requests
    go to the other tasks) when that is seen, i.e. at the first server step after ``g``, for every method alike.

    Args:
        server: a built server.
        local_update: as for :func:`run`.
        evaluate: ``(task, params [d]) -> value`` (e.g. test accuracy of the flat parameters), higher is better.
        every: grid spacing in simulated seconds, ``> 0``.
        horizon: the last grid time is the largest multiple of ``every`` not above ``horizon``.
        targets: task -> value at which the task stops (None: no task stops).

    Returns:
        ``{"grid": [g_1, ...], "values": {task: [v(g_1), ...]}, "time_to_target": {task: g or None},
        "steps": server steps taken}``; a stopped task's values after its target time are None.
    """
    if not (math.isfinite(float(every)) and every > 0):
        raise ValueError(f"every must be a finite number of seconds > 0, got {every!r}")
    if not (math.isfinite(float(horizon)) and horizon >= every):
        raise ValueError(f"horizon must be a finite number of seconds >= every={every}, got {horizon!r}")
    targets = dict(targets or {})
    unknown = set(targets) - set(server.names)
    if unknown:
        raise ValueError(f"targets name unknown tasks {sorted(unknown)}; the tasks are {server.names}")
    grid = [every * k for k in range(1, int(math.floor(horizon / every + 1e-9)) + 1)]
    values: dict[str, list[float | None]] = {n: [] for n in server.names}
    reached: dict[str, float | None] = {n: None for n in server.names}
    cache: dict[str, tuple[Tensor, float]] = {}

    def value(task: str, params: Tensor) -> float:
        if task not in cache or cache[task][0] is not params:  # unchanged models are not evaluated twice
            cache[task] = (params, float(evaluate(task, params)))
        return cache[task][1]

    def record(upto: float, models: dict[str, Tensor], inclusive: bool) -> None:
        """Every grid time not yet recorded that lies before ``upto`` (or at it) takes ``models``."""
        while len(values[server.names[0]]) < len(grid):
            g = grid[len(values[server.names[0]])]
            if g > upto or (g == upto and not inclusive):
                return
            to_stop = []
            for n in server.names:
                if n not in models:
                    values[n].append(None)
                    continue
                v = value(n, models[n])
                values[n].append(v)
                if n in targets and reached[n] is None and v >= targets[n]:
                    reached[n] = g
                    to_stop.append(n)
            for n in to_stop:
                server.stop_task(n)
                models.pop(n)

    steps = 0
    while not server.done:
        request = server.pop()
        if request is None:
            break
        sent = server.sent_params(request)
        delta = local_update(request, sent) - sent
        before = {n: server.params(n) for n in server.active_tasks}
        records = server.submit(request, delta)
        if records:
            steps += len(records)
            record(server.clock, before, inclusive=False)  # the grid times before this step saw `before`
        if server.clock > horizon:
            break
    record(horizon, {n: server.params(n) for n in server.active_tasks}, inclusive=True)
    return {"grid": grid, "values": values, "time_to_target": reached, "steps": steps}
