"""TimeToTarget: stop each task at its target accuracy and record the simulated time it took (FedAST §5)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_fedhet._checks import check_choice
from lightning_fedhet.asynchronous.module import MultiTaskModule
from lightning_fedhet.asynchronous.strategy import FedASTStrategy


class TimeToTarget(Callback):
    """After every validation run, stop each task whose ``"<task>/<monitor>"`` reached its target.

    A stopped task's requests are cancelled and its share of the clients goes to the other tasks
    (:meth:`FedASTStrategy.stop_task`), as in the paper's heterogeneous experiments. When every task has
    stopped, or the simulated clock passed ``max_sim_time``, training stops.

    Args:
        targets: task -> target value of the monitored metric (e.g. accuracy 0.8).
        monitor: the task module's logged metric name (logged as ``"<task>/<monitor>"``).
        mode: ``"max"`` (reached when ``value >= target``) or ``"min"`` (``value <= target``).
        max_sim_time: optional budget in simulated seconds.

    Attributes:
        times: task -> simulated seconds at which it reached its target (None until then).
        rounds: task -> the task's server steps ``t_m`` at that point.

    Evaluation happens when Lightning validates (``check_val_every_n_epoch`` epochs, an epoch being one server
    step of any task), so the recorded time is the time of the server step after which the target was seen.
    """

    def __init__(self, targets: Mapping[str, float], monitor: str = "val_acc", mode: str = "max",
                 max_sim_time: float | None = None) -> None:
        if not isinstance(targets, Mapping) or not targets:
            raise ValueError("targets must be a non-empty mapping task -> target value")
        check_choice(mode, "mode", ("max", "min"))
        if max_sim_time is not None and not float(max_sim_time) > 0:
            raise ValueError(f"max_sim_time must be > 0 seconds, got {max_sim_time!r}")
        self.targets = {str(k): float(v) for k, v in targets.items()}
        if any(not math.isfinite(v) for v in self.targets.values()):
            raise ValueError(f"targets must be finite, got {dict(targets)}")
        self.monitor = monitor
        self.mode = mode
        self.max_sim_time = None if max_sim_time is None else float(max_sim_time)
        self.times: dict[str, float | None] = {k: None for k in self.targets}
        self.rounds: dict[str, int | None] = {k: None for k in self.targets}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, FedASTStrategy):
            raise TypeError(f"TimeToTarget needs Trainer(strategy=FedASTStrategy(...)), got "
                            f"{type(trainer.strategy).__name__}")
        if not isinstance(pl_module, MultiTaskModule):
            raise TypeError(f"TimeToTarget needs a MultiTaskModule, got {type(pl_module).__name__}")
        unknown = set(self.targets) - set(pl_module.task_names)
        if unknown:
            raise ValueError(f"targets name unknown tasks {sorted(unknown)}; the tasks are {pl_module.task_names}")

    def _reached(self, value: float, target: float) -> bool:
        return value >= target if self.mode == "max" else value <= target

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if trainer.sanity_checking or strategy.server is None:
            return
        server = strategy.server
        for task, target in self.targets.items():
            key = f"{task}/{self.monitor}"
            if self.times[task] is not None or key not in trainer.callback_metrics:
                continue
            if self._reached(float(trainer.callback_metrics[key]), target):
                self.times[task] = float(server.clock)
                self.rounds[task] = server.round(task)
                strategy.stop_task(task)
        over_budget = self.max_sim_time is not None and server.clock > self.max_sim_time
        if server.done or all(t is not None for t in self.times.values()) or over_budget:
            trainer.should_stop = True

    def state_dict(self) -> dict:
        return {"times": dict(self.times), "rounds": dict(self.rounds)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.times = dict(state_dict["times"])
        self.rounds = dict(state_dict["rounds"])
