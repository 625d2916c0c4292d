"""Server-side fidelity: what the rules divide by, how buffers are averaged, and which checkpoints are refused."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAvg
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import LossyChannel, ShiftedExponential
from tests.helpers import TinyClassifier, quiet_trainer, toy_dataset


class ConstantDelta(pl.LightningModule):
    """One scalar weight; the loss ``-x w`` on a client whose samples all hold ``x`` makes one SGD step at lr 1
    move ``w`` by exactly ``x``: every client sends the same delta every round."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return -(x.mean() * self.w)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_known_p_divides_by_the_probability_of_being_aggregated():
    # clients 0, 1 send +1 and never lose an upload; clients 2, 3 send -1 and lose 80 % of uploads.
    # Unbiased: E[step] = sum_i alpha_i x_i = (1 + 1 - 1 - 1) / 4 = 0 when p_i = P(aggregated) = 0.5 (1 - q_i).
    # Dividing by P(available) = 0.5 instead gives E = 0.5 (0.5 + 0.5 - 0.1 - 0.1) = +0.40.
    # Per-round std of the unbiased step: sqrt(2 (0.5)^2 0.25 + 2 (2.5)^2 0.09) = 1.12, so over 1,500 rounds the
    # mean has SE 0.029: the tolerance 0.15 is > 5 SE, and 0.40 is 14 SE away.
    x = torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat_interleave(2).unsqueeze(1)
    data = FederatedDataModule(TensorDataset(x), [[0, 1], [2, 3], [4, 5], [6, 7]], batch_size=2)
    rounds = 1500
    strategy = FedHetStrategy(
        algorithm=FedAvg(weighting="known_p"),
        participation=Bernoulli(0.5),
        channel=LossyChannel(uplink=[0.0, 0.0, 0.8, 0.8]),
        engine="vmap",
        seed=11,
    )
    model = ConstantDelta()
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(model, datamodule=data)
    mean_step = float(model.w) / rounds
    assert abs(mean_step) < 0.15, mean_step


def test_aggregation_probabilities_include_links_and_the_deadline():
    latency = ShiftedExponential(shift=0.5, mean=1.0, speed_factors=(1.0,), group_fractions=(1.0,))
    strategy = FedHetStrategy(
        participation=Bernoulli([0.5, 0.4]),
        channel=LossyChannel(uplink=[0.1, 0.0], downlink=[0.0, 0.5]),
        latency=latency,
        deadline=2.0,
        local_steps=[1, 2],
    )
    data = FederatedDataModule(toy_dataset(8), [np.arange(4), np.arange(4, 8)], batch_size=2)
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(TinyClassifier(), datamodule=data)
    # P(on time) = P(K (0.5 + E) <= 2), E ~ Exp(1): K=1 -> 1 - exp(-1.5); K=2 -> 1 - exp(-0.5)
    planner = strategy.server.planner
    probs = planner.aggregation_probs(0, np.array([1, 2]))
    expected = torch.tensor([0.5 * 0.9 * (1 - np.exp(-1.5)), 0.4 * 0.5 * (1 - np.exp(-0.5))], dtype=torch.float64)
    torch.testing.assert_close(probs, expected)


class BatchNormNet(pl.LightningModule):
    """BatchNorm straight on the input, then a linear head: a client's running statistics after ``K`` full-batch
    steps are known in closed form (``m_K = 0.9^K m_0 + (1 - 0.9^K) mean``, the same for the unbiased variance)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RunningStatsProbe(Callback):
    def __init__(self) -> None:
        self.stats: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        bn = pl_module.net[0]
        self.stats.append((bn.running_mean.clone(), bn.running_var.clone()))


def test_batchnorm_statistics_are_averaged_with_normalised_weights():
    # Known-p weights 1/(N p) = 1.25 per arrived client: with 2 arrivals they sum to 2.5, and averaging running_var
    # (local values 0.9^10 = 0.35 x global after 10 steps on data of variance ~1e-4) with them gives
    # 1 + 2.5 (0.35 - 1) < 0. The server must average buffers over the arrived clients with sample weights that sum
    # to one; here (equal sizes) the plain mean of the arrived clients' closed-form statistics, round by round.
    # Slips caught: the rule's weights on buffers, a divisor over every client, buffers left unaveraged.
    gen = torch.Generator().manual_seed(0)
    x = 1.0 + 0.01 * torch.randn(64, 2, generator=gen)
    y = torch.zeros(64)
    parts = [np.arange(i * 16, (i + 1) * 16) for i in range(4)]
    data = FederatedDataModule(TensorDataset(x, y), parts, batch_size=16)  # one full-client batch per step
    probe = RunningStatsProbe()
    strategy = FedHetStrategy(algorithm=FedAvg(weighting="known_p"), participation=Bernoulli(0.2), local_steps=10)
    trainer = quiet_trainer(strategy=strategy, max_epochs=15, limit_val_batches=0, callbacks=[probe])
    trainer.fit(BatchNormNet(), datamodule=data)
    assert any(len(h["received"]) >= 2 for h in strategy.history)  # the case that went negative before
    keep = 0.9**10
    mean, var = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    for record, (got_mean, got_var) in zip(strategy.history, probe.stats):
        arrived = record["received"].tolist()
        if arrived:
            local_means = [keep * mean + (1 - keep) * x[parts[i]].double().mean(0) for i in arrived]
            local_vars = [keep * var + (1 - keep) * x[parts[i]].double().var(0, unbiased=True) for i in arrived]
            mean, var = sum(local_means) / len(arrived), sum(local_vars) / len(arrived)
        torch.testing.assert_close(got_mean.double(), mean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got_var.double(), var, atol=1e-6, rtol=1e-5)
    assert (var > 0).all()


def test_step_checkpoints_are_refused_naming_the_setting(tmp_path):
    data = FederatedDataModule(toy_dataset(40), [np.arange(20), np.arange(20, 40)], batch_size=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    # the sequential engine: 8 Lightning steps a round, so step 5 is mid-round (vmap's one step a round never is)
    strategy = FedHetStrategy(local_steps=4, engine="sequential")
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, enable_checkpointing=True, callbacks=[checkpoint])
    with pytest.raises(RuntimeError, match="every_n_train_steps"):
        trainer.fit(TinyClassifier(), datamodule=data)
    assert not list(tmp_path.glob("*.ckpt"))  # nothing written that could not be resumed


def test_cafed_probe_losses_are_each_available_clients_loss_at_the_global_model():
    from lightning_fedhet.algorithms import CAFed
    from lightning_fedhet.participation import Markov

    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    class Recording(CAFed):
        def observe_losses(self, round, losses):
            seen.append((round, losses.clone(), self.params.clone()))
            super().observe_losses(round, losses)

    ds = toy_dataset(48)
    data = FederatedDataModule(ds, [np.arange(i * 8, (i + 1) * 8) for i in range(6)], batch_size=4)
    strategy = FedHetStrategy(algorithm=Recording(tau=0.0, loss_source="probe"), participation=Markov(p=0.5, lam=0.6))
    quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0).fit(TinyClassifier(), datamodule=data)
    assert [r for r, _, _ in seen] == [0, 1, 2]
    streams = strategy.server.streams
    x, y = ds.tensors
    for (round, losses, params), record in zip(seen, strategy.history):
        available = set(record["available"].tolist())
        assert {i for i in range(6) if not torch.isnan(losses[i])} == available
        weight, bias = torch.split(params, [15, 3])
        for client in available:
            idx = torch.from_numpy(streams.probe_indices(round, client))
            expected = F.cross_entropy(x[idx] @ weight.view(3, 5).T + bias, y[idx])
            assert float(losses[client]) == pytest.approx(float(expected), abs=1e-5)


def _server_with_lossy_uplink(seed: int = 3):
    """Four clients (sizes 1..4), all available; client 3 loses its upload (q = 0.999999, fixed seed); FedAvg
    weighted by samples."""
    from lightning_fedhet.data.streams import ClientStreams
    from lightning_fedhet.federation import RoundPlanner
    from lightning_fedhet.participation import Full
    from lightning_fedhet.server import Server

    dataset = TensorDataset(torch.zeros(10, 1))
    streams = ClientStreams(dataset, [[0], [1, 2], [3, 4, 5], [6, 7, 8, 9]], batch_size=2, seed=seed)
    algorithm = FedAvg(weighting="samples")
    channel = LossyChannel(uplink=[0.0, 0.0, 0.0, 0.999999])
    planner = RoundPlanner(Full(), algorithm, streams, channel=channel, seed=seed)
    return Server(planner, algorithm, torch.zeros(3), num_parameters=3)


def test_submit_cohort_equals_submitting_each_row():
    deltas = torch.tensor([[1.0, 2.0, 3.0], [float("nan"), 0.0, 0.0], [3.0, -3.0, 6.0], [5.0, 5.0, 5.0]])
    losses = [0.1, 0.2, 0.3, 0.4]
    one_by_one, cohort = _server_with_lossy_uplink(), _server_with_lossy_uplink()
    for server in (one_by_one, cohort):
        server.begin_round(0)
    taken = [one_by_one.submit(c, deltas[c], losses[c]) for c in range(4)]
    assert cohort.submit_cohort([0, 1, 2, 3], deltas, losses) == taken == [True, False, True, False]
    # by hand: rows 0 and 2 arrive (row 1 is NaN, rejected; client 3's upload is lost), weights |D_i| = 1 and 3
    expected = (1 * deltas[0] + 3 * deltas[2]) / 4
    for server in (one_by_one, cohort):
        torch.testing.assert_close(server.close_round(), expected)
        assert server.rejected_total == 1
        assert server.history[-1]["received"].tolist() == [0, 2]


def test_submit_cohort_needs_one_row_and_one_loss_per_client():
    server = _server_with_lossy_uplink()
    server.begin_round(0)
    with pytest.raises(ValueError, match="one delta row and one loss per client"):
        server.submit_cohort([0, 1], torch.zeros(3, 3), [0.0, 0.0])
