"""Media callbacks: PNG files without W&B, W&B images / tables / histograms / summary with an offline run."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning_fedhet.callbacks import (
    AccuracyVsSimTime,
    ExitAccuracyTable,
    ParticipationHeatmap,
    RoundMetrics,
    RunSummary,
    WeightHistogram,
)
from lightning_fedhet.callbacks.plots import participation_matrix
from lightning_fedhet.model_zoo import EarlyExitNet
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

from lightning_fedhet import FedAvg, FederatedDataModule, FederationSpec, FedHetStrategy, Full, UniformSample
from lightning_fedhet.early_exit_module import EarlyExitClassifier
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import LossyChannel, ShiftedExponential
from tests.helpers import TinyClassifier, quiet_trainer, toy_dataset
from tests.wandb_records import offline_run

N = 12


def test_participation_matrix_codes_by_hand():
    history = [
        {"available": torch.tensor([0, 1, 2]), "selected": torch.tensor([1, 2]), "received": torch.tensor([2]),
         "rejected": torch.tensor([1])},
        {"available": torch.tensor([3]), "selected": torch.tensor([3]), "received": torch.tensor([], dtype=torch.long),
         "rejected": torch.tensor([], dtype=torch.long)},
    ]
    # codes: 0 unavailable, 1 available, 2 selected (no update received), 3 received, 4 rejected
    expected = np.array([[1, 0], [4, 0], [3, 0], [0, 2]], dtype=np.int8)
    np.testing.assert_array_equal(participation_matrix(history, 4), expected)


def _datamodule(nan_clients=(0,)):
    """N clients of 4 samples each; the listed clients hold NaN features, so their updates are rejected."""
    x, y = toy_dataset(4 * N).tensors
    x = x.clone()
    for c in nan_clients:
        x[4 * c : 4 * c + 4] = float("nan")
    parts = [np.arange(4 * i, 4 * i + 4) for i in range(N)]
    return FederatedDataModule(TensorDataset(x, y), parts, batch_size=2, val_dataset=toy_dataset(12, seed=1))


def _media_callbacks():
    return [ParticipationHeatmap(), WeightHistogram(), AccuracyVsSimTime(metric="val_loss"), RunSummary()]


def _strategy():
    return FedHetStrategy(
        algorithm=FedAvg(),
        participation=Bernoulli(0.7),
        selection=UniformSample(6),
        channel=LossyChannel(uplink=0.3),
        latency=ShiftedExponential(shift=0.1, mean=0.2),
        local_steps=2,
        seed=2,
    )


def _colours(path):
    image = np.asarray(Image.open(path).convert("RGB"))
    return image, {tuple(c) for c in image.reshape(-1, 3)[:: 7]}


@pytest.mark.filterwarnings("ignore:.*rejected.*")
def test_media_callbacks_write_pngs_without_wandb(tmp_path):
    callbacks = _media_callbacks()
    heatmap, weights, curve, summary = callbacks
    strategy = _strategy()
    logger = CSVLogger(tmp_path)
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, logger=logger, callbacks=[RoundMetrics(), *callbacks],
                            check_val_every_n_epoch=1)
    trainer.fit(TinyClassifier(), datamodule=_datamodule())
    media = tmp_path / "lightning_logs" / "version_0" / "media"
    sizes = {
        "participation.png": (900, 480),
        "aggregation_weights_plot.png": (800, 450),
        "val_loss_vs_time.png": (1000, 400),
        "run_summary_plot.png": (1200, 400),
    }
    assert sorted(p.name for p in media.iterdir()) == sorted([*sizes, "run_summary.json"])
    for name, size in sizes.items():
        image, colours = _colours(media / name)
        assert (image.shape[1], image.shape[0]) == size, name
        assert len(colours) > 20, name  # drawn, not a blank canvas
        assert (image < 200).any(axis=2).mean() > 0.01, name  # at least 1 % of the pixels are dark ink
    # the heat-map shows received (green #31a354) and unavailable (#f2f2f2) cells
    image = np.asarray(Image.open(media / "participation.png").convert("RGB")).reshape(-1, 3)
    for colour in ((0x31, 0xA3, 0x54), (0xF2, 0xF2, 0xF2)):
        assert (image == colour).all(axis=1).sum() > 500, colour
    assert heatmap.written == [media / "participation.png"]
    assert [p.name for p in summary.written] == ["run_summary_plot.png", "run_summary.json"]
    assert weights.written and curve.written
    # a non-rejected client state never produces a red cell: the poisoned client 0 is the only one rejected
    matrix = participation_matrix(strategy.history, N)
    assert set(np.nonzero(matrix == 4)[0].tolist()) <= {0}


def test_run_summary_totals_by_hand(tmp_path):
    # Full participation, lossless, 4 clients x 2 local steps x 3 rounds of a 18-parameter float32 model
    dm = FederatedDataModule(toy_dataset(16), [np.arange(4 * i, 4 * i + 4) for i in range(4)], batch_size=2)
    strategy = FedHetStrategy(algorithm=FedAvg(), participation=Full(), local_steps=2, seed=0)
    summary = RunSummary()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, save_on_train_epoch_end=True)
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, callbacks=[summary, checkpoint],
                            enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(TinyClassifier(), datamodule=dm)
    model_bytes = 18 * 4
    expected = {
        "rounds": 3,
        "selected": 12,
        "trained": 12,
        "received": 12,
        "rejected": 0,
        "rounds_without_update": 0,
        "local_steps": 24,
        "wasted_steps": 0,
        "upload_bytes": 12 * model_bytes,
        "download_bytes": 12 * model_bytes,
        "sim_time": 0.0,
        "server_memory_bytes": 0,
        "model_bytes": model_bytes,
        "checkpoint_bytes": (tmp_path / "last.ckpt").stat().st_size,
        "checkpoint_note": f"checkpoint last.ckpt: {(tmp_path / 'last.ckpt').stat().st_size / 1024:.2f} KB",
    }
    assert summary.summary == expected
    written = json.loads((tmp_path / "media" / "run_summary.json").read_text())
    assert written == expected


def _early_exit_model():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(5, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU())]
    net = EarlyExitNet(blocks, [1, 2], [nn.Linear(8, 3), nn.Linear(8, 3)])
    return EarlyExitClassifier(net, num_classes=3, lr=0.1, momentum=0.0, weight_decay=0.0)


def test_exit_accuracy_table_records_each_exit_at_each_validation(tmp_path):
    table = ExitAccuracyTable()
    dm = FederatedDataModule(toy_dataset(40), [np.arange(10 * i, 10 * i + 10) for i in range(4)], batch_size=5,
                             val_dataset=toy_dataset(30, seed=1))
    seen = []

    class Spy(ExitAccuracyTable):  # reads the metrics right after each validation
        def on_validation_end(self, trainer, pl_module):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if "_acc_exit" in k})

    trainer = quiet_trainer(strategy=FedHetStrategy(local_steps=1, seed=0), max_epochs=4, callbacks=[table, Spy()],
                            check_val_every_n_epoch=2, default_root_dir=tmp_path)
    trainer.fit(_early_exit_model(), datamodule=dm)
    assert table.rows == [(r, e, seen[i][f"val_acc_exit{e}"]) for i, r in enumerate((2, 4)) for e in (1, 2)]
    image, colours = _colours(tmp_path / "media" / "exit_accuracy_plot.png")
    assert image.shape[:2] == (450, 800) and len(colours) > 20


def test_media_callbacks_warn_instead_of_drawing_nothing(tmp_path):
    table, curve = ExitAccuracyTable(), AccuracyVsSimTime()
    trainer = quiet_trainer(strategy=FedHetStrategy(local_steps=1, seed=0), max_epochs=1, callbacks=[table, curve],
                            default_root_dir=tmp_path)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(TinyClassifier(), datamodule=_datamodule(nan_clients=()))
    messages = " ".join(str(w.message) for w in caught)
    assert "ExitAccuracyTable saw no 'val_acc_exit<e>'" in messages
    assert "AccuracyVsSimTime saw no 'val_acc'" in messages
    assert not (tmp_path / "media").exists()


@pytest.mark.filterwarnings("ignore:.*rejected.*")
def test_offline_wandb_run_holds_config_media_histograms_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(project="fedhet-test", save_dir=str(tmp_path), offline=True)
    callbacks = _media_callbacks()
    strategy = _strategy()
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, logger=logger, callbacks=[RoundMetrics(), *callbacks],
                            check_val_every_n_epoch=1, default_root_dir=tmp_path)
    trainer.fit(TinyClassifier(), datamodule=_datamodule())
    logger.experiment.finish()
    run = offline_run(tmp_path)

    config = run["config"]["fedhet"]
    # every setting of the federation (a new FederationSpec field that is not logged fails here), in W&B's config
    for key in ("strategy", "participation.args", *(field.name for field in dataclasses.fields(FederationSpec))):
        assert key in config, key
    assert (config["algorithm"], config["participation"], config["participation.args"]) == ("FedAvg", "Bernoulli",
                                                                                            "p=0.7")
    assert config["num_clients"] == N and config["seed"] == 2 and config["selection"] == "UniformSample(k=6)"

    rows = run["history"]
    image = next(r for r in rows if "media/participation._type" in r)
    assert image["media/participation._type"] == "image-file" and image["round"] == 3
    assert (run["dir"] / "files" / image["media/participation.path"]).is_file()
    assert any("media/aggregation_weights_plot.path" in r for r in rows)
    assert any("media/val_loss_vs_time.path" in r for r in rows)

    histograms = [r for r in rows if r.get("media/aggregation_weights._type") == "histogram"]
    arrived = [r for r in strategy.history if r["weights"]]
    assert [h["round"] for h in histograms] == [r["round"] + 1 for r in arrived]
    assert [sum(h["media/aggregation_weights.values"]) for h in histograms] == [len(r["weights"]) for r in arrived]

    # round metrics: one value per round on the "round" axis, in the validation's row
    received = [(r["round"], r["round/received"]) for r in rows if "round/received" in r and "val_loss" in r]
    assert received == [(r["round"] + 1, len(r["received"])) for r in strategy.history]

    summary = run["summary"]
    totals = callbacks[-1].summary
    assert summary["summary/rounds"] == 3
    assert summary["summary/received"] == totals["received"] == sum(len(r["received"]) for r in strategy.history)
    assert summary["summary/upload_bytes"] == sum(r["upload_bytes"] for r in strategy.history)
    table = next(r for r in rows if "media/run_summary.path" in r)
    written = json.loads((run["dir"] / "files" / table["media/run_summary.path"]).read_text())
    assert ["rounds", "3"] in written["data"]
    # W&B media replace the PNG files
    assert not any(c.written for c in callbacks)
    assert not (tmp_path / "media").exists()
    # every chart's x-axis is the round
    assert {"glob": "*", "step_metric": "round"} in run["metrics"]
