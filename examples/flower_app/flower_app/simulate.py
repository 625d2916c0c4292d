"""The same experiment in one process with FedHetStrategy: ``python -m flower_app.simulate`` (from this folder).

Reads the run config from pyproject.toml; ``--set key=value`` overrides an entry (e.g. ``--set rule=fedau``). With
the same config, the Flower run's global model after each round is this one's, up to float summation order
(tests/flower/test_deployment.py compares them). ``--save PATH`` writes the final model's ``state_dict`` and the
history as the ServerApp's ``output-path`` does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tomli
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from flower_app.task import BATCH_SIZE, client_partitions, eval_dataset, federation, make_module
from lightning_fedhet import FederatedDataModule, FedHetStrategy


def run_config(overrides: list[str]) -> dict:
    path = Path(__file__).resolve().parents[1] / "pyproject.toml"
    cfg = dict(tomli.loads(path.read_text())["tool"]["flwr"]["app"]["config"])
    for item in overrides:
        key, value = item.split("=", 1)
        cfg[key] = type(cfg[key])(value) if key in cfg else value
    return cfg


def run(cfg: dict) -> tuple:
    """Train the federation of run config ``cfg`` in process; returns ``(module, strategy)``."""
    num_clients = int(cfg["num-clients"])
    train, parts = client_partitions(cfg, num_clients)
    val_dataset = eval_dataset(cfg) if int(cfg["eval-samples"]) > 0 else None
    datamodule = FederatedDataModule(train, parts, batch_size=BATCH_SIZE, val_dataset=val_dataset)
    strategy = FedHetStrategy(**federation(cfg))
    trainer = Trainer(
        strategy=strategy, max_epochs=int(cfg["num-server-rounds"]), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = make_module(cfg)
    trainer.fit(model, datamodule=datamodule)
    return model, strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--save", default=None, metavar="PATH", help="write the final state_dict and history here")
    args = parser.parse_args()
    cfg = run_config(args.set)
    model, strategy = run(cfg)
    if args.save:
        torch.save({"state_dict": model.state_dict(), "history": strategy.history}, args.save)
    if int(cfg["eval-samples"]) <= 0:
        return
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(model, DataLoader(eval_dataset(cfg), batch_size=500), verbose=False)[0]
    print({name: round(float(v), 4) for name, v in metrics.items()})


if __name__ == "__main__":
    main()
