"""What the server, the clients and the in-process twin share: the model, each client's data, the federation.

Every function takes the run config (``[tool.flwr.app.config]`` in pyproject.toml, or ``context.run_config``),
so the Flower run and ``python -m flower_app.simulate`` are the same experiment.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from lightning_fedhet import Dirichlet
from lightning_fedhet.algorithms import MIFA, Algorithm, FedAU, FedAvg, FedVARP
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data.datamodule import split_dataset
from lightning_fedhet.data.datasets import fashion_mnist
from lightning_fedhet.participation import Bernoulli

BATCH_SIZE = 32
RULES = {"fedavg": FedAvg, "fedvarp": FedVARP, "mifa": MIFA, "fedau": FedAU}


def make_module(cfg: dict[str, Any]) -> Classifier:
    """The small Fashion-MNIST CNN, initialised from the run's seed (the same w_0 everywhere)."""
    torch.manual_seed(int(cfg["seed"]))
    return Classifier("fmnist_cnn", num_classes=10, lr=float(cfg["lr"]), model_kwargs={"width": 16})


def federation(cfg: dict[str, Any]) -> dict[str, Any]:
    """The server rule and the heterogeneity, as keyword arguments of FedHetStrategy and FedHetFlowerStrategy."""
    name = str(cfg["rule"]).lower()
    if name not in RULES:
        raise ValueError(f"rule must be one of {sorted(RULES)}, got {cfg['rule']!r}")
    algorithm: Algorithm = RULES[name]()
    return dict(
        algorithm=algorithm,
        participation=Bernoulli(float(cfg["participation"])),
        local_steps=int(cfg["local-steps"]),
        seed=int(cfg["seed"]),
    )


@functools.lru_cache(maxsize=2)
def _fashion_mnist(data_dir: str) -> tuple[TensorDataset, TensorDataset]:
    return fashion_mnist(data_dir or None)


def client_partitions(cfg: dict[str, Any], num_clients: int) -> tuple[TensorDataset, list[np.ndarray]]:
    """The pooled training set and each client's indices into it (Dirichlet label skew, then a fixed subset)."""
    train, _ = _fashion_mnist(str(cfg["data-dir"]))
    parts = split_dataset(train, Dirichlet(float(cfg["dirichlet-alpha"])), num_clients, int(cfg["seed"]))
    keep = int(cfg["samples-per-client"])
    return train, [p[:keep] for p in parts]


def client_dataset(cfg: dict[str, Any], partition_id: int, num_partitions: int) -> Subset:
    """What the node with ``partition-id`` holds, in the order of its partition."""
    train, parts = client_partitions(cfg, num_partitions)
    return Subset(train, parts[partition_id].tolist())


def eval_dataset(cfg: dict[str, Any]) -> TensorDataset:
    """The first ``eval-samples`` test images (evaluated on the global model by the server)."""
    _, test = _fashion_mnist(str(cfg["data-dir"]))
    n = int(cfg["eval-samples"])
    return TensorDataset(*(t[:n] for t in test.tensors))
