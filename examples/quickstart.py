"""Quickstart: FedAvg on Fashion-MNIST with 100 heterogeneous clients (Dirichlet 0.5), 10 per round.

    python examples/quickstart.py                    # ~2 minutes on a 2-core CPU, prints every round
    python examples/quickstart.py --logger wandb     # also log to W&B (offline unless you are logged in)

Figures (participation heat-map, aggregation weights, accuracy against simulated time, run summary) are written
as PNG files to ``<save-dir>/.../media/`` (W&B images with ``--logger wandb``), and the last round is checkpointed
(``last.ckpt``). The same run from a config: ``lightning-fedhet fit --config configs/quickstart.yaml``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_fedhet.callbacks import (
    AccuracyVsSimTime,
    ParticipationHeatmap,
    RoundPrinter,
    RunSummary,
    WeightHistogram,
)

from lightning_fedhet import Dirichlet, FedAvg, FedHetStrategy, UniformSample
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import FashionMNISTFederated
from lightning_fedhet.system import ShiftedExponential


def make_logger(kind: str, save_dir: str):
    if kind == "none":
        return False
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir, name="quickstart")
    from lightning.pytorch.loggers import WandbLogger

    offline = not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "online")
    return WandbLogger(project="lightning-fedhet", name="quickstart", save_dir=save_dir, offline=offline)


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=80, help="communication rounds (default 80)")
    parser.add_argument("--local-steps", type=int, default=10, help="local SGD steps per client per round")
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1, help="client learning rate in round 1")
    parser.add_argument("--lr-decay", type=float, default=0.97, help="client learning rate factor per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="folder with the Fashion-MNIST IDX files (optional)")
    parser.add_argument("--logger", choices=["none", "csv", "wandb"], default="none")
    parser.add_argument("--save-dir", default="outputs/quickstart")
    args = parser.parse_args()

    start = time.perf_counter()
    seed_everything(args.seed, verbose=False)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    data = FashionMNISTFederated(
        num_clients=100, partitioner=Dirichlet(0.5), batch_size=32, data_dir=args.data_dir, val_size=2000
    )
    model = Classifier("fmnist_cnn", num_classes=10, lr=args.lr, lr_decay=args.lr_decay, model_kwargs={"width": 16})
    strategy = FedHetStrategy(
        algorithm=FedAvg(weighting="participating"),
        participation=UniformSample(args.clients_per_round),
        local_steps=args.local_steps,
        # a simulated clock for the time axis (no deadline: training is unchanged); FedAST's Fashion-MNIST step time
        latency=ShiftedExponential.fedast("fmnist"),
        seed=args.seed,
    )
    trainer = Trainer(
        strategy=strategy,
        max_epochs=args.rounds,  # one epoch = one communication round
        check_val_every_n_epoch=min(5, args.rounds),  # every 5 rounds (a short run: at its end)
        num_sanity_val_steps=0,
        logger=make_logger(args.logger, args.save_dir),
        default_root_dir=args.save_dir,
        callbacks=[
            RoundPrinter(),  # one line per round, for logs (RoundProgressBar is the interactive alternative)
            ModelCheckpoint(save_last=True, save_top_k=0, save_on_train_epoch_end=True),  # last round
            ParticipationHeatmap(),
            WeightHistogram(),
            AccuracyVsSimTime(),
            RunSummary(),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    accuracy = trainer.test(model, datamodule=data, verbose=False)[0]["test_acc"]
    steps = sum(sum(h["local_steps"].values()) for h in strategy.history)
    print(
        f"final test accuracy {accuracy:.4f} after {len(strategy.history)} rounds "
        f"({steps} local steps, {time.perf_counter() - start:.1f} s)"
    )
    return accuracy


if __name__ == "__main__":
    main()
