"""RoundMetrics: round/* in callback_metrics (monitorable), logged once per round, federated config logged."""

import csv
import dataclasses
import warnings

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_fedhet.callbacks import RoundMetrics, round_metrics
from torch.utils.data import TensorDataset

from lightning_fedhet import IID, FedAvg, FederatedDataModule, FederationSpec, FedHetStrategy, Full, UniformSample
from lightning_fedhet.config_summary import federated_config
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import LossyChannel, ShiftedExponential
from tests.helpers import TinyClassifier, quiet_trainer, toy_dataset

# TinyClassifier(5 features, 3 classes): 5*3 weights + 3 biases, float32
MODEL_BYTES = (5 * 3 + 3) * 4


def _record(**overrides):
    record = {
        "round": 4,
        "available": torch.tensor([0, 1, 2, 5]),
        "selected": torch.tensor([1, 2, 5]),
        "received": torch.tensor([2]),
        "rejected": torch.tensor([5]),
        "local_steps": {1: 3, 2: 4, 5: 2},
        "weights": {2: 1.0},
        "upload_bytes": 300,
        "download_bytes": 300,
        "sim_time": 12.5,
        "wasted_steps": 5,
        "memory_bytes": 64,
    }
    record.update(overrides)
    return record


def test_round_metrics_counts_a_hand_made_record():
    assert round_metrics(_record()) == {
        "round/available": 4.0,
        "round/selected": 3.0,
        "round/trained": 3.0,
        "round/received": 1.0,
        "round/rejected": 1.0,
        "round/local_steps": 9.0,
        "round/upload_bytes": 300.0,
        "round/download_bytes": 300.0,
        "round/sim_time": 12.5,
        "round/wasted_steps": 5.0,
        "round/memory_bytes": 64.0,
    }


def _datamodule(n=40, clients=8, val=True):
    return FederatedDataModule(
        toy_dataset(n), IID(), num_clients=clients, batch_size=4, val_dataset=toy_dataset(20, seed=1) if val else None
    )


def test_round_metrics_enter_callback_metrics_each_round():
    seen = []

    class Spy(RoundMetrics):  # reads callback_metrics where ModelCheckpoint does: at train-epoch end
        def on_train_epoch_end(self, trainer, pl_module):
            super().on_train_epoch_end(trainer, pl_module)
            seen.append(float(trainer.callback_metrics["round/received"]))

    strategy = FedHetStrategy(participation=Bernoulli(0.5), local_steps=2, seed=3)
    trainer = quiet_trainer(strategy=strategy, max_epochs=4, callbacks=[Spy()])
    trainer.fit(TinyClassifier(), datamodule=_datamodule(val=False))
    assert seen == [float(len(r["received"])) for r in strategy.history]
    assert float(trainer.callback_metrics["round/local_steps"]) == 2.0 * len(strategy.history[-1]["local_steps"])


@pytest.mark.parametrize("validate", [True, False], ids=["with-validation", "no-validation"])
def test_model_checkpoint_can_monitor_round_received(tmp_path, validate):
    strategy = FedHetStrategy(participation=Bernoulli(0.5), local_steps=1, seed=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="round/received", mode="max", save_top_k=1)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=5, callbacks=[RoundMetrics(), checkpoint], enable_checkpointing=True
    )
    trainer.fit(TinyClassifier(), datamodule=_datamodule(val=validate))
    received = [len(r["received"]) for r in strategy.history]
    assert len(set(received)) > 1, received  # Bernoulli(0.5) over 8 clients: the counts differ between rounds
    assert float(checkpoint.best_model_score) == max(received)
    best_round = received.index(max(received))  # ties keep the first (a later equal score does not replace it)
    assert f"epoch={best_round}-" in checkpoint.best_model_path


def _csv_rows(logger):
    with open(f"{logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_validated_rounds_share_the_validation_row(tmp_path, engine):
    strategy = FedHetStrategy(participation=UniformSample(3), local_steps=2, seed=0, engine=engine)
    logger = CSVLogger(tmp_path)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=4, logger=logger, callbacks=[RoundMetrics()], check_val_every_n_epoch=2
    )
    trainer.fit(TinyClassifier(), datamodule=_datamodule())
    rows = [r for r in _csv_rows(logger) if r["round"]]
    assert [int(float(r["round"])) for r in rows] == [1, 2, 3, 4]
    assert [float(r["round/received"]) for r in rows] == [3.0] * 4
    # rounds 2 and 4 validated: their round metrics are in the validation's own row
    assert [bool(r["val_loss"]) for r in rows] == [False, True, False, True]


def test_round_metrics_are_logged_once_per_round(tmp_path):
    """Needs the strategy to stop logging round/* itself (RoundMetrics does it)."""
    strategy = FedHetStrategy(participation=UniformSample(3), local_steps=2, seed=0)
    logger = CSVLogger(tmp_path)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=4, logger=logger, callbacks=[RoundMetrics()], check_val_every_n_epoch=2
    )
    trainer.fit(TinyClassifier(), datamodule=_datamodule())
    rows = [r for r in _csv_rows(logger) if r["round/received"]]
    assert len(rows) == 4, [(r["step"], r["round"]) for r in rows]


def test_federated_config_goes_to_log_hyperparams(tmp_path):
    """The default ``engine="auto"`` is logged as set, and the engine that ran beside it: a linear model on a CPU
    passes vmap's checks, and a 1-round fit is below the 200 rounds from which auto compiles on a CPU."""
    strategy = FedHetStrategy(algorithm=FedAvg(weighting="participating"), participation=UniformSample(3),
                              local_steps=2, seed=7)
    logger = CSVLogger(tmp_path)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, logger=logger, callbacks=[RoundMetrics()])
    trainer.fit(TinyClassifier(), datamodule=_datamodule())
    with open(f"{logger.log_dir}/hparams.yaml") as f:
        logged = yaml.safe_load(f)["fedhet"]
    assert logged == {
        "strategy": "FedHetStrategy",
        "algorithm": "FedAvg",
        "algorithm.weighting": "participating",
        "algorithm.server_lr": 1.0,
        "participation": "UniformSample",
        "participation.args": "k=3",
        "selection": "algorithm",
        "channel": "lossless",
        "local_steps": 2,
        "latency": None,
        "deadline": None,
        "engine": "auto",
        "compile": None,
        "num_clients": 8,
        "partitioner": "IID()",
        "partition_seed": 0,
        "seed": 7,
        "optimizer_state": "reset",
        "client_weights": "uniform",
        "max_update_norm": None,
        "update_norm_action": "reject",
        "engine.ran": "vmap",
        "engine.compile": False,
    }


def test_tensorboards_hparams_yaml_holds_the_engine_that_ran(tmp_path):
    # TensorBoard's logger writes hparams.yaml once, before engine="auto" has chosen; the callback rewrites it
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)
    trainer = quiet_trainer(strategy=FedHetStrategy(seed=7), max_epochs=1, logger=logger, callbacks=[RoundMetrics()])
    trainer.fit(TinyClassifier(), datamodule=_datamodule())
    with open(f"{logger.log_dir}/hparams.yaml") as f:
        logged = yaml.safe_load(f)["fedhet"]
    assert (logged["engine"], logged["engine.ran"], logged["engine.compile"]) == ("auto", "vmap", False)


def test_every_setting_of_the_spec_is_logged(tmp_path):
    # A new FederationSpec field that federated_config leaves out fails here: each setting has its own key in the
    # loggers' hyper-parameters (set to a value other than its default, so a key logged from elsewhere cannot pass).
    spec = FederationSpec(
        algorithm=FedAvg(server_lr=0.5), participation=Bernoulli(0.5), local_steps=2,
        selection=UniformSample(2), channel=LossyChannel(uplink=0.1), latency=ShiftedExponential(),
        deadline=3.0, num_clients=8, partitioner=IID(), engine="sequential", compile=False, seed=3,
        optimizer_state="persist", client_weights="samples", max_update_norm=5.0, update_norm_action="clip",
    )
    logger = CSVLogger(tmp_path)
    trainer = quiet_trainer(strategy=FedHetStrategy(spec=spec), max_epochs=1, logger=logger)
    trainer.fit(TinyClassifier(), datamodule=_datamodule())
    with open(f"{logger.log_dir}/hparams.yaml") as f:
        logged = yaml.safe_load(f)["fedhet"]
    settings = {field.name for field in dataclasses.fields(FederationSpec)}
    assert settings <= set(logged), sorted(settings - set(logged))
    assert (logged["latency"], logged["deadline"]) == (repr(spec.latency), 3.0)
    assert (logged["optimizer_state"], logged["client_weights"]) == ("persist", "samples")
    assert (logged["max_update_norm"], logged["update_norm_action"]) == (5.0, "clip")
    assert (logged["selection"], logged["num_clients"], logged["partitioner"]) == ("UniformSample(k=2)", 8, "IID()")
    assert (logged["engine"], logged["engine.ran"], logged["engine.compile"]) == ("sequential", "sequential", False)


def test_federated_config_of_a_plain_datamodule_setup():
    strategy = FedHetStrategy(
        participation=Full(),
        local_steps=np.arange(1, 21),  # a per-client vector: summarised, not 20 columns
        channel=LossyChannel(uplink=0.25),
        num_clients=20,
        partitioner=[np.arange(i, i + 2) for i in range(20)],
        seed=4,
    )
    config = federated_config(strategy)
    assert config["local_steps"] == "20 values in [1, 20], mean 10.5"
    assert config["partitioner"] == "explicit index lists (20 clients)"
    assert config["num_clients"] == 20 and config["seed"] == 4
    assert config["channel"].startswith("LossyChannel(uplink=0.25")
    assert "partition_seed" not in config
    short = federated_config(FedHetStrategy(local_steps=[1, 2, 3], num_clients=3, partitioner=IID()))
    assert short["local_steps"] == [1, 2, 3]


def test_warns_when_every_update_is_rejected_and_nothing_was_ever_aggregated():
    x, y = toy_dataset(24).tensors
    poisoned = TensorDataset(torch.full_like(x, float("nan")), y)  # every client's delta is NaN
    dm = FederatedDataModule(poisoned, IID(), num_clients=4, batch_size=4)
    strategy = FedHetStrategy(local_steps=1, seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, callbacks=[RoundMetrics()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), datamodule=dm)
    messages = [str(w.message) for w in caught]
    assert sum("every client update (4) was rejected" in m for m in messages) == 2, messages
    assert sum("no client update ever aggregated" in m for m in messages) == 1, messages
    assert strategy.rejected_total == 8


def test_no_warning_when_updates_arrive():
    strategy = FedHetStrategy(local_steps=1, seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, callbacks=[RoundMetrics()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), datamodule=_datamodule(val=False))
    assert not [w for w in caught if "rejected" in str(w.message) or "aggregated" in str(w.message)]


def test_round_metrics_need_the_federated_strategy():
    trainer = quiet_trainer(max_epochs=1, callbacks=[RoundMetrics()])
    loader = torch.utils.data.DataLoader(toy_dataset(8), batch_size=4)
    with pytest.raises(TypeError, match="RoundMetrics needs Trainer\\(strategy=FedHetStrategy"):
        trainer.fit(TinyClassifier(), train_dataloaders=loader)
