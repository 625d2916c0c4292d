"""The console script and the quickstart config, run for real on tiny budgets."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fedhet.data.datasets import DEBIAN_FASHION_MNIST

ROOT = Path(__file__).resolve().parents[1]
needs_fmnist = pytest.mark.skipif(
    not Path(os.environ.get("FEDHET_FASHION_MNIST", DEBIAN_FASHION_MNIST)).is_dir(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)


@needs_fmnist
def test_cli_fit_with_quickstart_config(tmp_path):
    from lightning_fedhet.cli import main

    cli = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.max_epochs=2",
            "--trainer.check_val_every_n_epoch=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--model.init_args.lr=0.05",
            "--data.init_args.val_size=500",
        ]
    )
    strategy = cli.trainer.strategy
    assert type(strategy).__name__ == "FedHetStrategy"
    assert len(strategy.history) == 2
    assert all(len(h["received"]) == 10 for h in strategy.history)
    assert strategy.federation.num_clients == 100
    assert 0.0 < float(cli.trainer.callback_metrics["val_acc"]) <= 1.0


def test_console_script_help():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_fedhet.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "fit" in result.stdout and "test" in result.stdout


@needs_fmnist
def test_cli_logs_rounds_to_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    from lightning.pytorch.loggers import WandbLogger

    from lightning_fedhet.cli import main

    logged = {}
    original = WandbLogger.log_metrics

    def spy(self, metrics, step=None):
        logged.update(metrics)
        return original(self, metrics, step)

    monkeypatch.setattr(WandbLogger, "log_metrics", spy)

    cli = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.max_epochs=1",
            "--trainer.check_val_every_n_epoch=1",
            "--trainer.logger=WandbLogger",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.logger.init_args.project=fedhet-test",
            "--trainer.strategy.init_args.local_steps=2",
            "--data.init_args.val_size=200",
        ]
    )
    assert logged["round/received"] == 10
    assert logged["round/local_steps"] == 20
    assert "val_acc" in logged
    cli.trainer.logger.experiment.finish()
    assert list(Path(tmp_path).glob("wandb/offline-run-*"))


@pytest.mark.parametrize("config", sorted((ROOT / "configs" / "papers").glob("*.yaml")), ids=lambda p: p.stem)
def test_paper_configs_run_one_round(config, tmp_path):
    if "fmnist" in config.stem and not Path(os.environ.get("FEDHET_FASHION_MNIST", DEBIAN_FASHION_MNIST)).is_dir():
        pytest.skip("Fashion-MNIST not installed")
    from lightning_fedhet.cli import main

    cli = main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    history = cli.trainer.strategy.history
    # one epoch = one server step; Sync-ST's step records one entry per task, all with the same sync_round
    assert len(history) >= 1 and len({h.get("sync_round", h["round"]) for h in history}) == 1
