"""Small models and data shared by the tests."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule
from lightning_fedhet.algorithms import Algorithm, FedAvg
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import RoundPlanner
from lightning_fedhet.participation import Full
from lightning_fedhet.server import Server
from lightning_fedhet.system import LossyChannel

#: |D_i| of the clients of :func:`four_client_server`
FOUR_CLIENT_SIZES = (1, 2, 3, 4)


class TinyClassifier(pl.LightningModule):
    """Linear softmax classifier with plain SGD: an ordinary LightningModule, nothing federated."""

    def __init__(self, in_features: int = 5, num_classes: int = 3, lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        gen = torch.Generator().manual_seed(123)
        self.linear = torch.nn.Linear(in_features, num_classes)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(num_classes, in_features, generator=gen) * 0.1)
            self.linear.bias.zero_()

    def forward(self, x):
        return self.linear(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def toy_dataset(n: int = 120, in_features: int = 5, num_classes: int = 3, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=gen)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    return TensorDataset(x, y)


def equal_clients(num_clients: int, per_client: int = 10, batch_size: int = 5) -> FederatedDataModule:
    """``num_clients`` clients holding ``per_client`` consecutive samples each of :func:`toy_dataset`."""
    parts = [np.arange(i * per_client, (i + 1) * per_client) for i in range(num_clients)]
    return FederatedDataModule(toy_dataset(num_clients * per_client), parts, batch_size=batch_size)


class FailsAtCall(TinyClassifier):
    """Raises in its ``fail_at``-th ``training_step`` call (under vmap: inside the cohort's second lock-step)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated failure inside a round")
        return super().training_step(batch, batch_idx)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def quiet_trainer(**kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


def four_client_server(
    algorithm: Algorithm | None = None,
    num_parameters: int = 2,
    extra: int = 1,
    lost=(3,),
    local_steps=1,
    latency=None,
    **options,
) -> Server:
    """A framework-free server over four clients holding 1, 2, 3 and 4 samples, all available and selected; the
    uploads of the clients in ``lost`` are lost (loss probability 0.999999, lost by the draw at seed 3). The rule is
    FedAvg weighted by samples unless ``algorithm`` is given; the vector has ``num_parameters`` parameters followed
    by ``extra`` floating buffers, all zero at the start. ``options`` go to :class:`Server`."""
    bounds = np.cumsum((0,) + FOUR_CLIENT_SIZES)
    parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(FOUR_CLIENT_SIZES))]
    streams = ClientStreams(TensorDataset(torch.zeros(int(bounds[-1]), 1)), parts, batch_size=2, seed=3)
    algorithm = FedAvg(weighting="samples") if algorithm is None else algorithm
    uplink = [0.999999 if c in lost else 0.0 for c in range(len(FOUR_CLIENT_SIZES))]
    planner = RoundPlanner(Full(), algorithm, streams, local_steps=local_steps, channel=LossyChannel(uplink=uplink),
                           latency=latency, seed=3)
    return Server(planner, algorithm, torch.zeros(num_parameters + extra), num_parameters=num_parameters, **options)


def error_text(call, kind: type[Exception] = ValueError) -> str:
    """The message of the ``kind`` exception ``call()`` raises (the test fails if it raises nothing or another)."""
    with pytest.raises(kind) as err:
        call()
    return str(err.value)


#: the per-round fields of ``FedHetStrategy.history`` that say who took part: index tensors
ROUND_PARTIES = ("available", "selected", "received", "rejected")


def assert_same_rounds(expected: list[dict], actual: list[dict], *, parties=ROUND_PARTIES, rel: float = 1e-6,
                       abs: float = 1e-9) -> None:
    """Two ``history`` lists describe the same rounds: the same length, the same clients in each of ``parties``
    (exactly), the same local steps, and the same clients weighted with weights within ``rel``/``abs``
    (``rel=abs=0``: bit for bit)."""
    assert len(actual) == len(expected)
    for a, b in zip(expected, actual):
        for key in parties:
            assert torch.equal(a[key], b[key]), (a["round"], key)
        assert a["local_steps"] == b["local_steps"], a["round"]
        assert a["weights"].keys() == b["weights"].keys(), a["round"]
        for client, weight in a["weights"].items():
            assert b["weights"][client] == pytest.approx(weight, rel=rel, abs=abs), (a["round"], client)
