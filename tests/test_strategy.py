"""FedHetStrategy end to end: equivalences, reproducibility, resume, logging, bad input."""

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedhet import IID, Dirichlet, FedAvg, FederatedDataModule, FedHetStrategy, Full, UniformSample
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset


def _fit(strategy, dm, rounds, model=None, **trainer_kwargs):
    model = model or TinyClassifier()
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    return model, trainer


def test_one_client_equals_centralised_sgd_over_the_same_batches():
    ds = toy_dataset(50)
    dm = FederatedDataModule(ds, [np.arange(50)], batch_size=8)
    strategy = FedHetStrategy(algorithm=FedAvg(), participation=Full(), local_steps=4, seed=3)
    model, _ = _fit(strategy, dm, rounds=3)

    reference = TinyClassifier()
    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr)
    streams = strategy.server.streams
    for t in range(3):
        for idx in streams.batch_indices(t, 0, 4):
            x, y = ds.tensors[0][idx], ds.tensors[1][idx]
            opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(reference), atol=1e-6, rtol=0)
    assert len(strategy.history) == 3 and strategy.history[-1]["local_steps"] == {0: 4}


def test_equal_clients_one_step_equals_sgd_on_mean_gradient():
    n_clients, per_client = 4, 8
    ds = toy_dataset(n_clients * per_client)
    parts = [np.arange(i * per_client, (i + 1) * per_client) for i in range(n_clients)]
    # batch_size = client size, so each client's single step uses its whole data.
    dm = FederatedDataModule(ds, parts, batch_size=per_client)
    model, _ = _fit(FedHetStrategy(local_steps=1), dm, rounds=2)

    reference = TinyClassifier()
    for _ in range(2):
        reference.zero_grad()
        loss = sum(F.cross_entropy(reference(ds.tensors[0][p]), ds.tensors[1][p]) for p in parts) / n_clients
        loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= reference.lr * p.grad
    torch.testing.assert_close(flat_params(model), flat_params(reference), atol=1e-6, rtol=0)


def _dm(n=200, clients=10, seed=0):
    return FederatedDataModule(toy_dataset(n), Dirichlet(0.5), num_clients=clients, batch_size=8, seed=seed)


def _history_equal(h1, h2):
    assert len(h1) == len(h2)
    for a, b in zip(h1, h2):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert torch.equal(a[k], b[k]), k
            else:
                assert a[k] == b[k], k


def test_same_seed_reproduces_and_different_seed_differs():
    runs = []
    for seed in (0, 0, 1):
        strategy = FedHetStrategy(participation=UniformSample(3), local_steps=2, seed=seed)
        model, _ = _fit(strategy, _dm(), rounds=4)
        runs.append((flat_params(model), strategy.history))
    assert torch.equal(runs[0][0], runs[1][0])
    _history_equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])
    assert any(not torch.equal(a["selected"], b["selected"]) for a, b in zip(runs[0][1], runs[2][1]))


@pytest.mark.parametrize("optimizer_state", ["reset", "persist"])
def test_resume_from_round_checkpoint_equals_uninterrupted(tmp_path, optimizer_state):
    def strategy():
        return FedHetStrategy(participation=UniformSample(4), local_steps=3, seed=7, optimizer_state=optimizer_state)

    def model():
        return TinyClassifier(momentum=0.9)

    s_full = strategy()
    m_full, _ = _fit(s_full, _dm(), rounds=6, model=model())

    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1, every_n_epochs=1)
    s_first = strategy()
    _fit(s_first, _dm(), rounds=3, model=model(), enable_checkpointing=True, callbacks=[ckpt_cb])
    s_resumed = strategy()
    m_resumed = model()
    trainer = quiet_trainer(strategy=s_resumed, max_epochs=6)
    trainer.fit(m_resumed, datamodule=_dm(), ckpt_path=str(tmp_path / "last.ckpt"))

    torch.testing.assert_close(flat_params(m_resumed), flat_params(m_full), atol=0, rtol=0)
    _history_equal(s_resumed.history, s_full.history)
    assert [h["round"] for h in s_resumed.history] == list(range(6))


def test_validation_and_test_see_the_global_model():
    ds = toy_dataset(120)
    dm = FederatedDataModule(ds, IID(), num_clients=6, batch_size=8, val_dataset=ds, test_dataset=ds)
    strategy = FedHetStrategy(participation=UniformSample(2), local_steps=3)
    seen = []

    class Probe(pl.Callback):
        def on_validation_start(self, trainer, pl_module):
            seen.append(flat_params(pl_module).clone())

    model, trainer = _fit(strategy, dm, rounds=3, callbacks=[Probe()])
    assert len(seen) == 3
    # The model after the round's close is the algorithm's global vector.
    torch.testing.assert_close(seen[-1], strategy.global_params[: seen[-1].numel()])
    result = trainer.test(model, datamodule=dm, verbose=False)
    x, y = ds.tensors
    expected = F.cross_entropy(model(x), y)
    assert result[0]["test_loss"] == pytest.approx(float(expected), abs=1e-5)


class _PlainDataModule(pl.LightningDataModule):
    """A user's ordinary datamodule: nothing federated in it."""

    def __init__(self, dataset):
        super().__init__()
        self.dataset = dataset

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=4, shuffle=True)


def test_plain_datamodule_is_split_by_the_strategy():
    ds = toy_dataset(60)
    strategy = FedHetStrategy(num_clients=5, partitioner=IID(), local_steps=2, participation=UniformSample(2))
    _fit(strategy, _PlainDataModule(ds), rounds=2)
    sizes = strategy.server.streams.sizes
    assert sizes.tolist() == [12] * 5
    assert strategy.server.streams.batch_size == 4
    assert all(len(h["received"]) == 2 for h in strategy.history)


def test_plain_datamodule_without_partition_instructions_fails_clearly():
    with pytest.raises(ValueError, match="num_clients=...*partitioner"):
        _fit(FedHetStrategy(), _PlainDataModule(toy_dataset(20)), rounds=1)


def test_strategy_by_registered_name():
    model = TinyClassifier()
    trainer = quiet_trainer(strategy="fedhet", max_epochs=1)
    assert isinstance(trainer.strategy, FedHetStrategy)
    trainer.fit(model, datamodule=_dm())
    assert len(trainer.strategy.history) == 1


class _NaNForClientZero(TinyClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        client = self.trainer.strategy.server.current_client
        return loss * float("nan") if client == 0 else loss


def test_non_finite_update_is_rejected_counted_and_logged(tmp_path):
    ds = toy_dataset(40)
    parts = [np.arange(0, 20), np.arange(20, 40)]
    logger = CSVLogger(tmp_path, name="run")
    strategy = FedHetStrategy(local_steps=1, engine="sequential")  # the module reads the client training now
    model = _NaNForClientZero()
    before = flat_params(model).clone()
    _fit(strategy, FederatedDataModule(ds, parts, batch_size=20), rounds=2, model=model, logger=logger)
    assert torch.isfinite(flat_params(model)).all()
    assert strategy.rejected_total == 2
    assert strategy.history[0]["rejected"].tolist() == [0]
    assert strategy.history[0]["received"].tolist() == [1]
    assert strategy.history[0]["weights"] == {1: 1.0}
    # the global model moved by client 1's update alone: two rounds of one full-batch SGD step (lr 0.1) on client 1's
    # 20 samples from the initial weights (a slip that let client 0's NaN update in, or dropped client 1's, fails)
    reference = TinyClassifier()
    torch.testing.assert_close(before, flat_params(reference))
    x, y = ds.tensors[0][20:], ds.tensors[1][20:]
    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(reference), atol=1e-6, rtol=0)
    assert not torch.equal(flat_params(model), before)
    import csv

    rows = list(csv.DictReader(open(logger.log_dir + "/metrics.csv")))
    rejected = [float(r["round/rejected"]) for r in rows if r.get("round/rejected")]
    assert rejected == [1.0, 1.0]


def test_round_metrics_reach_the_logger(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    strategy = FedHetStrategy(participation=UniformSample(3), local_steps=2)
    _fit(strategy, _dm(), rounds=3, logger=logger)
    import csv

    rows = [r for r in csv.DictReader(open(logger.log_dir + "/metrics.csv")) if r.get("round/received")]
    assert [float(r["round/received"]) for r in rows] == [3.0, 3.0, 3.0]
    assert [float(r["round/local_steps"]) for r in rows] == [6.0, 6.0, 6.0]
    d = strategy.flat.dim
    assert [int(float(r["round/upload_bytes"])) for r in rows] == [3 * d * 4] * 3
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]


def test_optimizer_state_is_reset_per_client_by_default():
    seen = []

    class Probe(TinyClassifier):
        def on_train_batch_start(self, batch, batch_idx):
            pass

        def training_step(self, batch, batch_idx):
            opt = self.optimizers().optimizer
            self.step_of_client = 0 if self.trainer.strategy.server.current_client != self.last_client else (
                self.step_of_client + 1
            )
            self.last_client = self.trainer.strategy.server.current_client
            seen.append((self.step_of_client, len(opt.state)))
            return super().training_step(batch, batch_idx)

    model = Probe(momentum=0.9)
    model.last_client, model.step_of_client = None, 0
    # the sequential engine: one client's steps after another, each through the module's own optimizer
    strategy = FedHetStrategy(local_steps=3, participation=UniformSample(2), engine="sequential")
    _fit(strategy, _dm(), rounds=2, model=model)
    assert all(n == 0 for step, n in seen if step == 0)
    assert all(n > 0 for step, n in seen if step > 0)


def test_empty_round_closes_without_training():
    class Nobody(UniformSample):
        def _sample(self, round):
            return np.zeros(self.num_clients, dtype=bool) if round == 1 else super()._sample(round)

    strategy = FedHetStrategy(participation=Nobody(2), local_steps=2)
    _fit(strategy, _dm(), rounds=3)
    assert [len(h["received"]) for h in strategy.history] == [2, 0, 2]
    assert strategy.history[1]["local_steps"] == {}


def test_bad_strategy_arguments():
    with pytest.raises(ValueError, match="num_clients"):
        FedHetStrategy(num_clients=0)
    with pytest.raises(ValueError, match="local_steps"):
        FedHetStrategy(local_steps=0)
    with pytest.raises(ValueError, match="engine"):
        FedHetStrategy(engine="warp")
    with pytest.raises(ValueError, match="optimizer_state"):
        FedHetStrategy(optimizer_state="keep")


def test_k_larger_than_num_clients_fails_before_training():
    with pytest.raises(ValueError, match="k must be <= num_clients"):
        _fit(FedHetStrategy(participation=UniformSample(11)), _dm(clients=10), rounds=1)


def test_dirichlet_on_unlabelled_dataset_names_the_parameter():
    unlabelled = TensorDataset(torch.randn(30, 5))
    with pytest.raises(ValueError, match="partitioner=Dirichlet.*needs labels"):
        FederatedDataModule(unlabelled, Dirichlet(0.5), num_clients=3)


def test_gradient_accumulation_is_refused_because_it_would_mix_clients():
    with pytest.raises(ValueError, match="accumulate_grad_batches=1"):
        _fit(FedHetStrategy(local_steps=2), _dm(), rounds=1, accumulate_grad_batches=2)


def test_mixed_precision_and_gradient_clipping_run_through_lightning():
    for kwargs in ({"precision": "bf16-mixed"}, {"gradient_clip_val": 0.01}):
        strategy = FedHetStrategy(local_steps=2, participation=UniformSample(2))
        model, _ = _fit(strategy, _dm(), rounds=2, **kwargs)
        assert len(strategy.history) == 2 and torch.isfinite(flat_params(model)).all()
