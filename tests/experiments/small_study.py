"""The small study of the experiments tests, written against the public API only: 2 methods x 2 settings x 3 seeds
of multinomial logistic regression on a synthetic 3-class dataset, 8 clients, 4 rounds (Ray's workers import it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_fedhet import IID, Dirichlet, FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAvg, FedVARP
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.experiments import Cell, Study, federated_study
from lightning_fedhet.participation import Bernoulli

METHODS = {"FedAvg": FedAvg, "FedVARP": FedVARP}
SETTINGS = {"iid": {"alpha": None}, "dirichlet-0.3": {"alpha": 0.3}}
_DATA: dict = {}


def synthetic(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(10, 3, generator=torch.Generator().manual_seed(7))
    x = torch.randn(n, 10, generator=gen)
    return TensorDataset(x, (x @ w + 0.5 * torch.randn(n, 3, generator=gen)).argmax(1))


def datamodule(alpha: float | None) -> FederatedDataModule:
    """One datamodule object per setting (the seeds of a cell share it, as fit_seeds likes)."""
    if alpha not in _DATA:
        partitioner = IID() if alpha is None else Dirichlet(alpha)
        _DATA[alpha] = FederatedDataModule(synthetic(480, 0), partitioner, num_clients=8, batch_size=8,
                                           val_dataset=synthetic(200, 1))
    return _DATA[alpha]


def build(cell: Cell, seed: int):
    model = Classifier("logistic_regression", num_classes=3, lr=0.1, model_kwargs={"in_features": 10})
    strategy = FedHetStrategy(algorithm=METHODS[cell.method](), participation=Bernoulli(0.5), local_steps=2,
                              engine="vmap", seed=seed)
    return model, datamodule(cell.config["alpha"]), strategy


STUDY = federated_study("small", build, methods=METHODS, settings=SETTINGS, seeds=range(3), rounds=4,
                        eval_every=2, metric="val_acc", metrics=("val_acc", "val_loss"))


# ------------------------------------------------------------------------------------- a study whose runs fail
def faulty_run(cell: Cell, seed: int) -> dict:
    """``fail="always"`` raises every time; ``fail="once"`` raises on the first attempt only (a marker file in
    ``cell.config["marker_dir"]`` remembers it across processes)."""
    if cell.config["fail"] == "always":
        raise ValueError(f"{cell.method} always fails (seed {seed})")
    if cell.config["fail"] == "once":
        marker = Path(cell.config["marker_dir"]) / f"{cell.method}-{seed}"
        if not marker.exists():
            marker.write_text("failed once")
            raise RuntimeError("a lost worker, say")
    return {"metrics": {"value": float(np.float64(seed))}, "engine": "none"}


def faulty_study(marker_dir: str) -> Study:
    cells = tuple(Cell("s", name, {"fail": name, "marker_dir": marker_dir}) for name in ("always", "once", "never"))
    return Study(name="faulty", cells=cells, seeds=(0,), run=faulty_run)
