"""The FedAST configs through the console script, and the reproduction script, on tiny budgets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_fedhet.data.datasets import DEBIAN_FASHION_MNIST

ROOT = Path(__file__).resolve().parents[2]
needs_fmnist = pytest.mark.skipif(
    not Path(os.environ.get("FEDHET_FASHION_MNIST", DEBIAN_FASHION_MNIST)).is_dir(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)


@needs_fmnist
@pytest.mark.parametrize("config, rule", [("fedast_tasks.yaml", "FedAST"), ("fedast_syncst.yaml", "SyncST")])
def test_cli_runs_the_fedast_configs(tmp_path, config, rule):
    from lightning_fedhet.asynchronous import FedASTStrategy, MultiTaskModule
    from lightning_fedhet.cli import FedHetCLI

    cli = FedHetCLI(args=["fit", "--config", str(ROOT / "configs" / "papers" / config), "--trainer.max_epochs=2",
                f"--trainer.default_root_dir={tmp_path}"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, FedASTStrategy) and type(strategy.rule).__name__ == rule
    assert isinstance(cli.model, MultiTaskModule)
    assert cli.model.task_names == ["fmnist_cnn", "fmnist_mlp", "synthetic"]
    # each task module kept its own hyperparameters (not the outer module's config)
    assert cli.model.tasks["fmnist_cnn"].hparams.lr == 0.06 and cli.model.tasks["synthetic"].hparams.lr == 0.01
    assert strategy.server.num_clients == 200
    assert len(strategy.history) >= 2 and strategy.history[-1]["sim_time"] > 0
