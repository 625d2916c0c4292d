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
seconds) that :func:`run` drives with any local solver ``(request, w_sent) -> w_local``.
"""

from lightning_fedhet.asynchronous.latency import Constant, request_duration
from lightning_fedhet.asynchronous.module import MultiTaskModule
from lightning_fedhet.asynchronous.rules import FedAST, SyncST, allocation_scores, normalized_variance, split_budget
from lightning_fedhet.asynchronous.server import FedASTServer, Request, SyncSTServer, Task, TaskServer, run
from lightning_fedhet.asynchronous.strategy import FedASTStrategy
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
    "Constant",
    "request_duration",
    "normalized_variance",
    "allocation_scores",
    "split_budget",
]
