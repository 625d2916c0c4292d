"""Runs the many-process cases of ``tests/test_strategy_ddp.py`` in ONE two-process launch (a script, not a test).

Usage: ``python tests/ddp_worker.py OUT_DIR [JOB ...]``. Lightning's ``popen`` launcher re-runs this script as
rank 1; both processes run every job in the same order, and each writes ``OUT_DIR/<job>.<rank>.pt``: the global
parameters, the history and job-specific extras, or the error a job raised. The test compares them with one-process
runs. Every Trainer here uses ``FedHetDDPStrategy(timeout=...)`` so a hang becomes an error, not a stuck test.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedhet import FederatedDataModule, FedHetDDPStrategy
from lightning_fedhet.algorithms import FedAvg, FedStale, FedVARP
from lightning_fedhet.participation import Bernoulli, UniformSample
from lightning_fedhet.system import LossyChannel, UniformSteps
from tests.engines.test_contract import CASES, ROUNDS, _run
from tests.helpers import TinyClassifier, equal_clients, quiet_trainer, toy_dataset

TIMEOUT = timedelta(seconds=int(os.environ.get("FEDHET_DDP_TIMEOUT", "100")))
DDP = dict(devices=2, accelerator="cpu")
#: contract cases also run with the vmap engine inside each process
VMAP_CASES = ("FedAvg-known_p", "FedStale", "MIFA", "FedNova", "FedCIS")
MEMORY_CASES = ("FedVARP", "MIFA", "FedStale")


class LoggingClassifier(TinyClassifier):
    """Logs its training loss with ``sync_dist=True`` (a collective at every step if taken literally)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


class ReducingClassifier(LoggingClassifier):
    """Also logs the loss's largest value and 1 per step, summed: reductions other than the mean."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("steps_taken", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        return loss


class BatchNormClassifier(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(5)

    def forward(self, x):
        return self.linear(self.norm(x))


class WrappedClassifier(TinyClassifier):
    """A submodule already wrapped in DistributedDataParallel (needs the process group, so built lazily)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.parallel.DistributedDataParallel(self.linear)


def strategy(**kwargs) -> FedHetDDPStrategy:
    return FedHetDDPStrategy(timeout=TIMEOUT, **kwargs)


def six_clients(batch_size: int = 4) -> FederatedDataModule:
    return equal_clients(6, per_client=16, batch_size=batch_size)


def three_clients() -> FederatedDataModule:
    return equal_clients(3, per_client=16, batch_size=4)


def fit(model, data, rounds: int = ROUNDS, ckpt_path=None, **kwargs):
    torch.manual_seed(0)
    s = kwargs.pop("strategy")
    trainer = quiet_trainer(strategy=s, max_epochs=rounds, limit_val_batches=0, **DDP, **kwargs)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return s, trainer


def result(s: FedHetDDPStrategy, **extra) -> dict:
    return {"params": s.global_params.clone(), "history": s.history, "placement": s.effective_placement, **extra}


# ---------------------------------------------------------------------------------------------- jobs
def job_contract(case: str, engine: str = "sequential") -> dict:
    s = _run({"engine": engine, "timeout": TIMEOUT}, case, FedHetDDPStrategy, **DDP)
    extra = {}
    if case in MEMORY_CASES:
        extra["memory"] = s.comm.gather_rows(s.algorithm.memory.state_dict())["data"]  # full on rank 0
    return result(s, **extra)


def job_bitwise() -> dict:
    torch.manual_seed(0)
    data = FederatedDataModule(toy_dataset(64), [np.arange(0, 32), np.arange(32, 64)], batch_size=8)
    s, _ = fit(TinyClassifier(momentum=0.5), data, strategy=strategy(algorithm=FedAvg(), local_steps=3,
                                                                      placement="by_client", seed=1))
    return result(s)


def ckpt_settings() -> dict:
    return dict(algorithm=FedVARP(), participation=Bernoulli(0.7), channel=LossyChannel(uplink=0.2),
                local_steps=UniformSteps(1, 3), seed=5)


def job_ckpt_save(out: Path) -> dict:
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt_2proc", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    s, _ = fit(TinyClassifier(momentum=0.5), six_clients(), strategy=strategy(**ckpt_settings()),
               callbacks=[checkpoint], enable_checkpointing=True)
    return result(s)


def job_ckpt_resume(out: Path) -> dict:
    s, _ = fit(TinyClassifier(momentum=0.5), six_clients(), strategy=strategy(**ckpt_settings()),
               ckpt_path=str(out / "ckpt_1proc.ckpt"))
    return result(s, memory=s.comm.gather_rows(s.algorithm.memory.state_dict())["data"])


def job_three_clients() -> dict:
    data = three_clients()
    s, _ = fit(TinyClassifier(), data, strategy=strategy(algorithm=FedAvg(), local_steps=[1, 2, 3], seed=2))
    return result(s)


#: what ReducingClassifier logs
REDUCED = ("train_loss", "loss_max", "steps_taken")


def job_uneven_vmap_logging() -> dict:
    """vmap on each process with unequal client steps per process (3 on one, 2 on the other): the round's logged
    mean must weight each process by its client steps, and a max or a sum merge as such."""
    data = three_clients()
    s, trainer = fit(ReducingClassifier(), data, strategy=strategy(algorithm=FedAvg(), local_steps=[1, 1, 3], seed=2,
                                                                  engine="vmap"))
    return result(s, **{name: float(trainer.callback_metrics[name]) for name in REDUCED})


def job_single_client(engine: str) -> dict:
    s, trainer = fit(LoggingClassifier(), six_clients(), strategy=strategy(
        algorithm=FedAvg(), participation=UniformSample(1), local_steps=2, seed=4, engine=engine))
    return result(s, train_loss=float(trainer.callback_metrics["train_loss"]))


def job_one_client() -> dict:
    data = FederatedDataModule(toy_dataset(16), [np.arange(16)], batch_size=4)
    s, _ = fit(TinyClassifier(), data, strategy=strategy(algorithm=FedStale(beta=0.5), local_steps=2, seed=2))
    return result(s)


def job_broadcast() -> dict:
    """Rank 1's initial weights differ: every process must start from rank 0's."""
    model = TinyClassifier(momentum=0.5)
    with torch.no_grad():
        model.linear.weight.add_(float(os.environ.get("LOCAL_RANK", "0")))
    s, _ = fit(model, six_clients(), strategy=strategy(**hetero(FedAvg())))
    return result(s)


def hetero(algorithm) -> dict:
    return dict(algorithm=algorithm, participation=Bernoulli(0.7), channel=LossyChannel(uplink=0.2),
                local_steps=UniformSteps(1, 3), seed=5)


def job_batchnorm() -> dict:
    """Floating (running mean/var) and integer (num_batches_tracked) buffers are averaged over both processes."""
    s, _ = fit(BatchNormClassifier(), six_clients(), strategy=strategy(**hetero(FedAvg())))
    return result(s, ints=s.server.global_ints.clone())


def job_persist(engine: str = "sequential") -> dict:
    s, _ = fit(TinyClassifier(momentum=0.5), six_clients(),
               strategy=strategy(**hetero(FedAvg()), optimizer_state="persist", engine=engine))
    return result(s)


def job_reject() -> dict:
    s, _ = fit(TinyClassifier(), six_clients(),
               strategy=strategy(**hetero(FedAvg()), max_update_norm=0.15, update_norm_action="reject"))
    return result(s, rejected_total=s.rejected_total)


def job_error(kind: str) -> dict:
    model, kwargs, settings = TinyClassifier(), {}, {}
    if kind == "accumulate":
        kwargs["accumulate_grad_batches"] = 2
    elif kind == "sync_batchnorm":
        model, kwargs["sync_batchnorm"] = BatchNormClassifier(), True
    elif kind == "ddp_wrapped":
        model = WrappedClassifier()
    elif kind == "placement":
        settings = dict(algorithm=FedVARP(), placement="balanced")
    fit(model, six_clients(), rounds=1, strategy=strategy(**settings), **kwargs)
    return {"error": None}


def jobs(out: Path) -> dict:
    table = {f"contract-{case}": (job_contract, case) for case in CASES}
    table.update({f"vmap-{case}": (job_contract, case, "vmap") for case in VMAP_CASES})
    table.update(
        {
            "bitwise": (job_bitwise,),
            "ckpt_save": (job_ckpt_save, out),
            "ckpt_resume": (job_ckpt_resume, out),
            "three_clients": (job_three_clients,),
            "uneven_vmap_logging": (job_uneven_vmap_logging,),
            "single_client": (job_single_client, "sequential"),
            "single_client_vmap": (job_single_client, "vmap"),
            "one_client": (job_one_client,),
            "broadcast": (job_broadcast,),
            "batchnorm": (job_batchnorm,),
            "persist": (job_persist,),
            "persist-vmap": (job_persist, "vmap"),
            "reject": (job_reject,),
        }
    )
    table.update({f"error-{kind}": (job_error, kind) for kind in ("accumulate", "sync_batchnorm", "ddp_wrapped",
                                                                     "placement")})
    return table


def main(out: Path, names: list[str]) -> None:
    table = jobs(out)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    for name in names or list(table):
        fn, *args = table[name]
        try:
            payload = fn(*args)
        except Exception as err:  # recorded for the test, which asserts on it
            payload = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        torch.save(payload, out / f"{name}.{rank}.pt")
        print(f"[rank {rank}] {name}: {'error' if payload.get('error') else 'ok'}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
