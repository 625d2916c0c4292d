"""MultiTaskModule: several ordinary LightningModules trained at once, one per task, by FedASTStrategy."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn


class MultiTaskModule(pl.LightningModule):
    """Holds one LightningModule per task (each with its own ``training_step``, optimizer and data) as one
    LightningModule that :class:`~lightning_fedhet.asynchronous.FedASTStrategy` trains.

    - Training: the strategy feeds ``(task, batch)`` pairs, the local steps of arriving requests in arrival
      order; ``training_step`` runs that task's own ``training_step`` and steps that task's own optimizer
      (manual optimization, since every task has its optimizer).
    - Validation/test: one dataloader per task (from the task's datamodule), each batch goes to its task's
      ``validation_step``/``test_step``. Tasks stopped by :meth:`stop` are skipped.
    - Logging: what a task module logs with ``self.log`` / ``self.log_dict`` is logged as ``"<task>/<name>"``
      (e.g. ``"fmnist/val_acc"``).

    Args:
        tasks: task name -> LightningModule (its ``configure_optimizers`` must return one optimizer, or a dict
            with only ``"optimizer"``; learning-rate schedulers are refused).
        datamodules: task name -> datamodule with per-client data (``client_indices``, ``train_dataset``,
            ``batch_size``, e.g. :class:`~lightning_fedhet.data.FederatedDataModule`); its ``val_dataloader``
            and ``test_dataloader`` evaluate the task's global model.

    Example::

        module = MultiTaskModule({"cnn": Classifier("fmnist_cnn"), "lr": Classifier("logistic_regression")},
                                 datamodules={"cnn": fmnist_dm, "lr": synthetic_dm})
        Trainer(strategy=FedASTStrategy(FedAST(requests=16, buffer=2)), max_epochs=100).fit(module)

    Why logging is re-routed: Lightning gives nested LightningModules the trainer but not the current hook, so
    a task module's own ``self.log`` would raise inside the outer module's hooks. The constructor therefore
    binds, on each task module, a ``log`` that forwards to this module's ``log`` with the task prefix (no
    dataloader suffix: the prefix already keeps the tasks apart). It is the only attribute this class sets on
    the modules it is given.
    """

    def __init__(self, tasks: Mapping[str, pl.LightningModule],
                 datamodules: Mapping[str, pl.LightningDataModule] | None = None) -> None:
        super().__init__()
        if not isinstance(tasks, Mapping) or not tasks:
            raise ValueError("tasks must be a non-empty mapping name -> LightningModule")
        for name, module in tasks.items():
            if not isinstance(module, pl.LightningModule):
                raise TypeError(f"tasks[{name!r}] must be a LightningModule, got {type(module).__name__}")
            if "/" in str(name) or "." in str(name):
                raise ValueError(f"task names may not contain '/' or '.', got {name!r}")
        datamodules = dict(datamodules or {})
        if datamodules and set(datamodules) != set(tasks):
            raise ValueError(f"datamodules name tasks {sorted(datamodules)}, but the tasks are {list(tasks)}")
        self.automatic_optimization = False
        self.task_names = [str(n) for n in tasks]
        self.tasks = nn.ModuleDict({str(n): m for n, m in tasks.items()})
        self.datamodules = {str(n): dm for n, dm in datamodules.items()}
        self.stopped: set[str] = set()
        self._eval_tasks: dict[str, list[str]] = {"val": [], "test": []}
        for name, module in self.tasks.items():
            module.log = functools.partial(self._log_task, name)

    # ------------------------------------------------------------------ logging
    def _log_task(self, task: str, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["add_dataloader_idx"] = False
        self.log(f"{task}/{name}", value, *args, **kwargs)

    # ------------------------------------------------------------------ control
    def stop(self, task: str) -> None:
        """Stop evaluating ``task`` (called by the strategy when the task stops training)."""
        if task not in self.tasks:
            raise KeyError(f"unknown task {task!r}; the tasks are {self.task_names}")
        self.stopped.add(task)

    def task_optimizer(self, task: str) -> Any:
        """The (Lightning-wrapped) optimizer of ``task``."""
        optimizers = self.optimizers()
        if not isinstance(optimizers, list):
            optimizers = [optimizers]
        return optimizers[self.task_names.index(task)]

    # ------------------------------------------------------------------ Lightning hooks
    def forward(self, task: str, *args: Any, **kwargs: Any) -> Any:
        return self.tasks[task](*args, **kwargs)

    def training_step(self, batch: tuple[str, Any], batch_idx: int) -> torch.Tensor:
        task, data = batch
        module = self.tasks[task]
        output = module.training_step(data, batch_idx)
        loss = output["loss"] if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"task {task!r}: training_step must return the loss tensor (or a dict with 'loss')")
        optimizer = self.task_optimizer(task)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        task = self._eval_tasks["val"][dataloader_idx]
        if task not in self.stopped:
            self.tasks[task].validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.tasks[self._eval_tasks["test"][dataloader_idx]].test_step(batch, batch_idx)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        optimizers = []
        for name, module in self.tasks.items():
            config = module.configure_optimizers()
            if isinstance(config, Mapping):
                if set(config) - {"optimizer"}:
                    raise ValueError(f"task {name!r}: configure_optimizers may return only an optimizer (FedAST "
                                     f"resets it for every request), got keys {sorted(config)}")
                config = config["optimizer"]
            if not isinstance(config, torch.optim.Optimizer):
                raise ValueError(f"task {name!r}: configure_optimizers must return one optimizer, got "
                                 f"{type(config).__name__}")
            optimizers.append(config)
        return optimizers

    def _loaders(self, stage: str) -> list:
        """One dataloader per task that has ``stage`` data (``self._eval_tasks[stage]`` maps index -> task)."""
        self._check_datamodules()
        loaders, names = [], []
        for name in self.task_names:
            dm = self.datamodules[name]
            loader = dm.val_dataloader() if stage == "val" else dm.test_dataloader()
            if isinstance(loader, list):
                if len(loader) > 1:
                    raise ValueError(f"task {name!r}: its datamodule must give at most one {stage} dataloader")
                if not loader:
                    continue  # this task has no such data
                loader = loader[0]
            loaders.append(loader)
            names.append(name)
        self._eval_tasks[stage] = names
        return loaders

    def _check_datamodules(self) -> None:
        if not self.datamodules:
            raise ValueError("MultiTaskModule needs datamodules={task: datamodule} to be trained or evaluated")

    def train_dataloader(self) -> Any:
        # FedASTStrategy replaces it by the arriving requests' batches, read from each task's datamodule.
        self._check_datamodules()
        return self.datamodules[self.task_names[0]].train_dataloader()

    def val_dataloader(self) -> list:
        return self._loaders("val")

    def test_dataloader(self) -> list:
        return self._loaders("test")

    def prepare_data(self) -> None:
        for dm in self.datamodules.values():
            dm.prepare_data()

    def setup(self, stage: str) -> None:
        for dm in self.datamodules.values():
            dm.setup(stage)
