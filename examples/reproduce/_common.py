"""Shared plumbing for the reproduction scripts: quiet Lightning runs, accuracy curves, tables and plots.

Nothing here is specific to one paper. Every script builds its data, participation and server rule, then calls
:func:`fit_federated`, which runs ``rounds`` Lightning epochs (= communication rounds) and records the global
model's validation accuracy every ``eval_every`` rounds.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback

REPO_ROOT = Path(__file__).resolve().parents[2]


def quiet() -> None:
    """Silence Lightning's banners and the warnings that do not matter for a CPU simulation."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available.*")
    warnings.filterwarnings("ignore", ".*LitLogger.*")
    warnings.filterwarnings("ignore", ".*no update arrived this round.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")


def seed_all(seed: int) -> None:
    """Seed Python, numpy and torch (model initialisation); the federation draws are seeded by the strategy."""
    seed_everything(int(seed), workers=False, verbose=False)


def default_out(name: str) -> str:
    return str(REPO_ROOT / "docs" / "results" / name)


class AccuracyRecorder(Callback):
    """Records ``(round, val_acc)`` after every validation run on the global model (rounds are 1-based)."""

    def __init__(self) -> None:
        self.curve: list[tuple[int, float]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or "val_acc" not in trainer.callback_metrics:
            return
        self.curve.append((trainer.current_epoch + 1, float(trainer.callback_metrics["val_acc"])))


def fit_federated(model, datamodule, strategy, rounds: int, eval_every: int) -> dict:
    """Train for ``rounds`` rounds; return the accuracy curve, wall-clock and CPU seconds, and the strategy."""
    recorder = AccuracyRecorder()
    trainer = Trainer(
        strategy=strategy,
        max_epochs=int(rounds),
        check_val_every_n_epoch=int(eval_every),
        logger=False,
        callbacks=[recorder],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(model, datamodule=datamodule)
    return {
        "curve": recorder.curve,
        "wall": time.perf_counter() - wall,
        "cpu": time.process_time() - cpu,
        "strategy": strategy,
    }


def final_accuracy(curve: Sequence[tuple[int, float]], rounds: int, window: float) -> float:
    """Mean accuracy over the evaluations in the last ``window`` fraction of the rounds (at least the last one)."""
    if not curve:
        return float("nan")
    start = rounds - window * rounds
    tail = [acc for r, acc in curve if r > start] or [curve[-1][1]]
    return float(np.mean(tail))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def fmt_pct(values: Sequence[float]) -> str:
    """``"mean ± std"`` in percent (std over seeds, ddof=1; 0 with one seed)."""
    m, s = mean_std(values)
    return f"{100 * m:.1f} ± {100 * s:.1f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounds, mean and std of several curves evaluated at the same rounds."""
    rounds = np.array([r for r, _ in curves[0]])
    accs = np.array([[a for _, a in c] for c in curves])
    return rounds, accs.mean(axis=0), accs.std(axis=0)


def plot_panels(panels: dict[str, dict[str, list]], path: str | os.PathLike, title: str, ylabel: str = "accuracy",
                ylim: tuple[float, float] | None = None) -> None:
    """One subplot per panel; in each, the mean curve (± std shading) of every method over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(max(5.0 * n, 8.0), 4.0), squeeze=False)
    for ax, (panel, methods) in zip(axes[0], panels.items()):
        for method, curves in methods.items():
            if not curves or not curves[0]:
                continue
            rounds, mean, std = mean_curve(curves)
            line, = ax.plot(rounds, mean, label=method, lw=1.4)
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        ax.set_title(panel)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def setup_torch(threads: int = 1) -> None:
    torch.set_num_threads(int(threads))
