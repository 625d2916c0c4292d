"""The console script and the configs, run for real on tiny budgets."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fedhet.data.datasets import DEBIAN_FASHION_MNIST

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ROOT / "configs" / "papers" / "upgapl_synthetic.yaml"  # needs no dataset download
needs_fmnist = pytest.mark.skipif(
    not Path(os.environ.get("FEDHET_FASHION_MNIST", DEBIAN_FASHION_MNIST)).is_dir(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)


def _cli(args):
    from lightning_fedhet.cli import FedHetCLI

    return FedHetCLI(args=args)


@needs_fmnist
def test_console_script_fit_exits_zero(tmp_path):
    script = Path(sys.executable).parent / "lightning-fedhet"
    result = subprocess.run(
        [
            str(script), "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_epochs=2",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.strategy.init_args.local_steps=2",
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LightningCLI object" not in result.stderr
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()  # the last round is checkpointed by default
    assert {"participation.png", "run_summary_plot.png"} <= {p.name for p in (run_dir / "media").iterdir()}
    assert "round    2/2 | available 10 | selected 10 | received 10 | local steps 20" in result.stdout


@needs_fmnist
def test_cli_fit_with_quickstart_config(tmp_path):
    cli = _cli(
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
    assert strategy.server.num_clients == 100
    assert 0.0 < float(cli.trainer.callback_metrics["val_acc"]) <= 1.0


def test_main_returns_zero_and_help_describes_the_federated_cli(capsys):
    from lightning_fedhet.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "federated learning under client heterogeneity" in out
    assert "One epoch is one communication round" in out and "--version" in out

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    packed = "".join(capsys.readouterr().out.split())  # the help wraps long class names across lines
    # the known model and datamodule classes include the library's own
    for name in ("lightning_fedhet.classifier.Classifier", "lightning_fedhet.early_exit_module.EarlyExitClassifier",
                 "lightning_fedhet.data.FashionMNISTFederated", "lightning_fedhet.data.SyntheticLeafFederated"):
        assert "knownsubclasses:" in packed and name in packed, name

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    import lightning_fedhet

    assert capsys.readouterr().out.startswith(f"lightning-fedhet {lightning_fedhet.__version__} (lightning ")


def test_config_error_is_one_line_naming_the_argument_with_exit_code_2(tmp_path, capsys):
    from lightning_fedhet.cli import main

    config = yaml.safe_load(SYNTHETIC.read_text())
    config["trainer"]["strategy"]["init_args"]["participation"] = {
        "class_path": "lightning_fedhet.UniformSample", "init_args": {"k": 0}
    }
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lightning-fedhet: error: trainer.strategy.init_args.participation.init_args.k: k must be an integer >= 1, "
        "got 0 (lightning_fedhet.UniformSample)"
    ]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--trainer.strategy.init_args.engine=gpu"], "trainer.strategy.init_args.engine: engine must be one of"),
        (["--data.init_args.num_clients=0"], "data.init_args.num_clients: num_clients must be >= 1, got 0"),
        (["--trainer.strategy.init_args.local_steps=0"],
         "trainer.strategy.init_args.local_steps: local_steps must be an integer >= 1, got 0"),
        (["--trainer.strategy.init_args.algorithm.init_args.q=maybe"],
         "trainer.strategy.init_args.algorithm.init_args.q: q must be one of ('known', 'estimate')"),
        # a callback appended to the config's seven: the list index names it
        (["--trainer.callbacks+=lightning_fedhet.callbacks.RoundPrinter", "--trainer.callbacks.every_n_rounds=0"],
         "trainer.callbacks[7].init_args.every_n_rounds: every_n_rounds must be an integer >= 1, got 0 "
         "(lightning_fedhet.callbacks.RoundPrinter)"),
    ],
)
def test_other_config_errors_name_their_argument(tmp_path, capsys, overrides, expected):
    from lightning_fedhet.cli import main

    assert main(["fit", "--config", str(SYNTHETIC), *overrides, f"--trainer.default_root_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lightning-fedhet: error: {expected}"), err


def test_cli_config_is_saved_with_the_wandb_run(tmp_path, monkeypatch):
    from tests.wandb_records import offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = _cli(
        [
            "fit", "--config", str(SYNTHETIC), "--trainer.max_epochs=1", "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=WandbLogger",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.logger.init_args.project=fedhet-test",
        ]
    )
    cli.trainer.logger.experiment.finish()
    run = offline_run(tmp_path)
    saved = run["config"]["cli"]
    assert saved["trainer"]["max_epochs"] == 1
    assert saved["trainer"]["strategy"]["init_args"]["algorithm"]["class_path"].endswith("UPGAPL")
    assert (run["dir"] / "files" / "lightning_config.yaml").is_file()
    assert yaml.safe_load((run["dir"] / "files" / "lightning_config.yaml").read_text())["trainer"]["max_epochs"] == 1
    assert (tmp_path / "config.yaml").is_file()  # Lightning's copy in the log directory (W&B's save_dir)


@needs_fmnist
def test_cli_logs_rounds_to_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    from lightning.pytorch.loggers import WandbLogger

    logged = {}
    original = WandbLogger.log_metrics

    def spy(self, metrics, step=None):
        logged.update(metrics)
        return original(self, metrics, step)

    monkeypatch.setattr(WandbLogger, "log_metrics", spy)

    cli = _cli(
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
            f"--trainer.default_root_dir={tmp_path}",
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
    cli = _cli(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert len(cli.trainer.strategy.history) == 1
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()
