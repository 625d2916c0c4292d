"""Where a study's runs execute: one interface, three backends.

The runner (:func:`~lightning_fedhet.experiments.runner.run_study`) hands a backend the missing (cell, seed)
pairs; the backend groups them into :class:`Task` s (:meth:`Backend.plan`), executes them and yields one
:class:`Outcome` per task as it finishes (:meth:`Backend.execute`). Every task runs through :func:`execute` in the
process that trains, so the records do not depend on the backend: the same code, the same thread count
(``Study.threads``), the same seeds. Only the driver writes records.

- :class:`InProcess`: one cell x seed at a time in this process, with ``study.run``. A failing run raises (it is
  the run you are debugging); the records already written stay.
- :class:`Stacked`: in this process, the missing seeds of a cell in one ``study.run_seeds`` run (``fit_seeds`` for
  :func:`~lightning_fedhet.experiments.federated.federated_study`); a study without ``run_seeds`` runs one seed
  at a time.
- :class:`Ray` (the ``[ray]`` extra): each cell x seed (or each group of ``seeds_per_task`` stacked seeds) a Ray
  task on a local cluster or, with ``address``, an existing one; a failed task is retried once and then recorded
  as failed with its error, never dropped.

``"auto"`` (:func:`resolve_backend`) picks :class:`Stacked` where the study has ``run_seeds``, else
:class:`InProcess`, and says so once.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning_fedhet.experiments.records import machine
from lightning_fedhet.experiments.study import Cell, Study

Started = Callable[["Task"], None]


@dataclasses.dataclass(frozen=True)
class Task:
    """Seeds of one cell that run together: ``stacked`` calls ``study.run_seeds(cell, seeds)``, otherwise
    ``study.run(cell, seed)`` for the one seed."""

    cell: Cell
    seeds: tuple[int, ...]
    stacked: bool = False

    def __post_init__(self) -> None:
        if not self.seeds or (not self.stacked and len(self.seeds) != 1):
            raise ValueError(f"a task runs one seed, or several stacked; got seeds={self.seeds}, "
                             f"stacked={self.stacked}")


@dataclasses.dataclass
class Outcome:
    """A finished task: one result per seed (as :func:`execute` returns them), or the error that ended it."""

    task: Task
    results: list[dict] | None = None
    error: str | None = None
    attempts: int = 1


def execute(study: Study, task: Task) -> list[dict]:
    """Run ``task`` in this process with ``study.threads`` torch threads; one result per seed, each with the keys
    that describe where and how long it ran (``device, torch, python, threads, wall_s, cpu_s, seeds_in_run``).

    The wall and CPU time of a stacked run are shared equally among its seeds. A result that continued a run an
    earlier process had begun (``result["resumed"] = {"from_rounds": [...], "wall_s", "cpu_s"}``, the earlier
    processes' seconds for that seed) gets them added, so that its record counts the whole run.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(int(study.threads))
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        if task.stacked:
            results = list(study.run_seeds(task.cell, list(task.seeds)))
        else:
            results = [study.run(task.cell, task.seeds[0])]
        n = len(task.seeds)
        wall, cpu = (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n
        where = machine()
    finally:
        torch.set_num_threads(previous)
    if len(results) != len(task.seeds):
        raise RuntimeError(f"{study.name} {task.cell.name}: {len(results)} results for seeds {list(task.seeds)}")
    out = []
    for result in results:
        if not isinstance(result, dict) or "metrics" not in result or "engine" not in result:
            raise TypeError(f"{study.name} {task.cell.name}: a run must return a dict with 'metrics' and 'engine', "
                            f"got {result if not isinstance(result, dict) else sorted(result)}")
        earlier = result.get("resumed") or {}
        out.append({**result, **where, "device": result.get("device") or where["device"],
                    "wall_s": round(wall + earlier.get("wall_s", 0.0), 2),
                    "cpu_s": round(cpu + earlier.get("cpu_s", 0.0), 2), "seeds_in_run": n})
    return out


class Backend:
    """How tasks execute. Subclasses implement :meth:`execute` and may regroup seeds in :meth:`plan`."""

    name = "backend"

    def plan(self, study: Study, missing: Sequence[tuple[Cell, Sequence[int]]]) -> list[Task]:
        """One task per (cell, seed), one seed each (the default)."""
        return [Task(cell, (int(seed),)) for cell, seeds in missing for seed in seeds]

    def execute(self, study: Study, tasks: Sequence[Task], started: Started | None = None) -> Iterator[Outcome]:
        """Run ``tasks``, yielding each :class:`Outcome` as it finishes; ``started(task)`` when one begins."""
        raise NotImplementedError

    def describe(self, study: Study) -> str:
        """One sentence for the log: what runs where."""
        return self.name


class InProcess(Backend):
    """One cell x seed at a time in this process (``study.run``); a failing run raises."""

    name = "in-process"

    def execute(self, study: Study, tasks: Sequence[Task], started: Started | None = None) -> Iterator[Outcome]:
        for task in tasks:
            if started is not None:
                started(task)
            yield Outcome(task, execute(study, task))

    def describe(self, study: Study) -> str:
        return f"in this process, one cell x seed at a time ({study.threads} torch thread(s))"


class Stacked(InProcess):
    """In this process, each cell's missing seeds in one ``study.run_seeds`` run (at most ``max_seeds`` each)."""

    name = "stacked"

    def __init__(self, max_seeds: int | None = None) -> None:
        if max_seeds is not None and int(max_seeds) < 1:
            raise ValueError(f"max_seeds must be >= 1 or None, got {max_seeds}")
        self.max_seeds = None if max_seeds is None else int(max_seeds)

    def plan(self, study: Study, missing: Sequence[tuple[Cell, Sequence[int]]]) -> list[Task]:
        if study.run_seeds is None:
            return super().plan(study, missing)
        return stacked_tasks(missing, self.max_seeds)

    def describe(self, study: Study) -> str:
        if study.run_seeds is None:
            return f"in this process, one seed at a time ({study.name} has no run_seeds to stack them)"
        size = "all missing seeds" if self.max_seeds is None else f"up to {self.max_seeds} seeds"
        return f"in this process, {size} of a cell stacked in one run ({study.threads} torch thread(s))"


def stacked_tasks(missing: Sequence[tuple[Cell, Sequence[int]]], size: int | None) -> list[Task]:
    """Each cell's seeds in groups of ``size`` (``None``: one group), every group a stacked task."""
    tasks = []
    for cell, seeds in missing:
        seeds = [int(s) for s in seeds]
        step = size or max(len(seeds), 1)
        tasks += [Task(cell, tuple(seeds[k:k + step]), stacked=True) for k in range(0, len(seeds), step)]
    return tasks


# ------------------------------------------------------------------------------------------------------------ Ray
class Ray(Backend):
    """Each task a Ray task; the driver (this process) writes every record.

    Args:
        address: an existing cluster to join (``"auto"``, ``"ray://host:10001"``, ...); ``None`` starts a local
            cluster for the run and stops it afterwards.
        workers: the local cluster's size in runs at once (its CPUs are ``workers x study.threads``); default
            ``os.cpu_count() // study.threads``. Ignored when joining a cluster.
        seeds_per_task: ``1``: each cell x seed a task (``study.run``); more: groups of that many seeds of a cell,
            each one stacked ``study.run_seeds`` task (where the study has ``run_seeds``).
        retries: times a failed task is tried again (application errors and lost workers alike) before it is
            recorded as failed.
        init_kwargs: more keyword arguments for ``ray.init``.

    Workers load the study by its ``source`` (a module path or a file, as ``fedhet-study`` and
    :func:`~lightning_fedhet.experiments.load_study` set it) or, without one, unpickle the study object (its
    functions must then be importable by the workers, e.g. defined in a module rather than in ``__main__``). On a
    cluster of several machines give every node the study's code and data (e.g. ``init_kwargs={"runtime_env":
    {"working_dir": "."}}``).
    """

    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None, seeds_per_task: int = 1,
                 retries: int = 1, init_kwargs: dict | None = None) -> None:
        if workers is not None and int(workers) < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if int(seeds_per_task) < 1:
            raise ValueError(f"seeds_per_task must be >= 1, got {seeds_per_task}")
        if int(retries) < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.address, self.workers, self.seeds_per_task = address, workers, int(seeds_per_task)
        self.retries, self.init_kwargs = int(retries), dict(init_kwargs or {})

    def plan(self, study: Study, missing: Sequence[tuple[Cell, Sequence[int]]]) -> list[Task]:
        if self.seeds_per_task > 1 and study.run_seeds is not None:
            return stacked_tasks(missing, self.seeds_per_task)
        return super().plan(study, missing)

    def describe(self, study: Study) -> str:
        where = f"the Ray cluster at {self.address}" if self.address else \
            f"a local Ray cluster of {self._workers(study)} worker(s) x {study.threads} thread(s)"
        unit = "each cell x seed" if self.seeds_per_task == 1 or study.run_seeds is None else \
            f"up to {self.seeds_per_task} stacked seeds of a cell"
        return f"on {where}, {unit} a task, retried {self.retries} time(s) before it is recorded as failed"

    def _workers(self, study: Study) -> int:
        return int(self.workers) if self.workers is not None else max(1, (os.cpu_count() or 1) // study.threads)

    def execute(self, study: Study, tasks: Sequence[Task], started: Started | None = None) -> Iterator[Outcome]:
        ray = import_ray()
        own_cluster = not ray.is_initialized()
        if own_cluster:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if self.address is None:
                kwargs |= {"num_cpus": self._workers(study) * study.threads, "object_store_memory": 256 * 2**20}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # Ray's notice about accelerator variables
                ray.init(address=self.address, **(kwargs | self.init_kwargs))
        pending: dict[Any, Task] = {}
        try:
            payload = ray.put(study.source if study.source is not None else study)
            remote = ray.remote(_ray_task).options(num_cpus=study.threads, max_retries=self.retries,
                                                   retry_exceptions=True)
            queue = list(tasks)
            capacity = max(1, int(ray.cluster_resources().get("CPU", 1)) // study.threads)
            pending = {remote.remote(payload, task): task for task in queue}
            for task in queue[:capacity]:
                if started is not None:
                    started(task)
            next_to_start = capacity
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    task = pending.pop(ref)
                    try:
                        outcome = Outcome(task, ray.get(ref))
                    except Exception as error:  # noqa: BLE001 - recorded with its message, never dropped
                        outcome = Outcome(task, error=_ray_error(error), attempts=self.retries + 1)
                    if next_to_start < len(queue) and started is not None:
                        started(queue[next_to_start])
                    next_to_start += 1
                    yield outcome
        finally:
            for ref in pending:  # interrupted: do not leave work running on a cluster we only joined
                ray.cancel(ref, force=True)
            if own_cluster:
                ray.shutdown()


def import_ray():
    """``ray``, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError("the Ray backend needs Ray: pip install 'lightning-fedhet[ray]'") from error
    return ray


_LOADED: dict[str, Study] = {}


def _ray_task(payload: str | Study, task: Task) -> list[dict]:
    """What a Ray worker runs: load the study (once per worker process) and :func:`execute` the task."""
    if isinstance(payload, str):
        from lightning_fedhet.experiments.study import load_study

        if payload not in _LOADED:
            _LOADED[payload] = load_study(payload)
        study = _LOADED[payload]
    else:
        study = payload
    return execute(study, task)


def _ray_error(error: BaseException) -> str:
    """A failed Ray task's error as the worker raised it: the remote traceback (without terminal colours), ending
    with the exception's line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    return text or f"{type(error).__name__}: {error!r}"


BACKENDS = {"in-process": InProcess, "inprocess": InProcess, "stacked": Stacked, "ray": Ray}


def resolve_backend(backend: str | Backend, study: Study) -> Backend:
    """A backend object from a name (``"auto"``, ``"in-process"``, ``"stacked"``, ``"ray"``) or itself."""
    if isinstance(backend, Backend):
        return backend
    if backend == "auto":
        return Stacked() if study.run_seeds is not None else InProcess()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', one of {sorted(set(BACKENDS))} or a Backend, got {backend!r}")
    return BACKENDS[backend]()
