"""Asynchronous simultaneous training of several models on one client pool (FedAST, Askin et al., UAI 2024).

Lightning: several ordinary LightningModules in a :class:`MultiTaskModule`, trained by :class:`FedASTStrategy`
with the rule :class:`FedAST` (or the synchronous baseline :class:`SyncST`); :class:`TimeToTarget` stops each
task at its target accuracy and records the simulated seconds it took::

    from lightning.pytorch import Trainer
    from lightning_fedhet.asynchronous import FedAST, FedASTStrategy, MultiTaskModule, TimeToTarget
    from lightning_fedhet.system import ShiftedExponential

    module = MultiTaskModule({"cnn": cnn, "lr": logreg}, datamodules={"cnn": fmnist_dm, "lr": synthetic_dm})
    strategy = FedASTStrategy(FedAST(option="D", requests=16, buffer=2, server_lr=0.1), local_steps=27,
                              latency=ShiftedExponential.fedast("fmnist"))
    ttt = TimeToTarget({"cnn": 0.80, "lr": 0.70})
    Trainer(strategy=strategy, max_epochs=-1, check_val_every_n_epoch=8, callbacks=[ttt]).fit(module)
    ttt.times        # {"cnn": seconds, "lr": seconds} of simulated time

Framework-free core: the rules build a :class:`FedASTServer` / :class:`SyncSTServer` (event-driven, simulated
seconds) on a client pool (:class:`CappedPool`, the paper's and the default, or :class:`AvailabilityPool`) that
:func:`run` drives with any local solver ``(request, w_sent) -> w_local``; :func:`run_on_grid` also evaluates
every task on one fixed grid of simulated times and stops each at its target.

Modules, bottom up: ``latency`` (request durations), ``allocation`` (Algorithms 3-4 arithmetic), ``pool``,
``task`` (Task, Request, per-task state), ``task_server`` (shared server machinery), ``fedast_server``,
``syncst_server``, ``rules`` (the configurations that build them), ``driver`` (run, run_on_grid), then the
Lightning side: ``module``, ``strategy``, ``time_to_target``.
"""

from lightning_fedhet.asynchronous.allocation import allocation_scores, normalized_variance, split_budget
from lightning_fedhet.asynchronous.driver import run, run_on_grid
from lightning_fedhet.asynchronous.fedast_server import FedASTServer
from lightning_fedhet.asynchronous.latency import Constant, request_duration
from lightning_fedhet.asynchronous.module import MultiTaskModule
from lightning_fedhet.asynchronous.pool import AvailabilityPool, CappedPool, ClientPool
from lightning_fedhet.asynchronous.rules import FedAST, SyncST
from lightning_fedhet.asynchronous.strategy import FedASTStrategy
from lightning_fedhet.asynchronous.syncst_server import SyncSTServer
from lightning_fedhet.asynchronous.task import Request, Task
from lightning_fedhet.asynchronous.task_server import TaskServer
from lightning_fedhet.asynchronous.time_to_target import TimeToTarget

__all__ = [
    "FedAST",
    "SyncST",
    "MultiTaskModule",
    "FedASTStrategy",
    "TimeToTarget",
    "Task",
    "Request",
    "TaskServer",
    "FedASTServer",
    "SyncSTServer",
    "run",
    "run_on_grid",
    "ClientPool",
    "CappedPool",
    "AvailabilityPool",
    "Constant",
    "request_duration",
    "normalized_variance",
    "allocation_scores",
    "split_budget",
]
