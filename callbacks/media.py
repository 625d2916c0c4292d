"""Media of a federated run: participation heat-map, aggregation weights, per-exit accuracy, accuracy against
simulated time and an end-of-run summary.

Each callback writes W&B media (``wandb.Image``, ``wandb.Table``, ``wandb.Histogram``) when a ``WandbLogger`` is
attached, and PNG files into ``<log dir>/media/`` otherwise (``png=True`` writes them in both cases). Figures are
drawn by :mod:`lightning_fedhet.callbacks.plots` from ``strategy.history``; nothing here changes training.

Example::

    from lightning_fedhet.callbacks import ParticipationHeatmap, RunSummary, WeightHistogram
    trainer = Trainer(strategy=FedHetStrategy(...), max_epochs=50,
                      callbacks=[ParticipationHeatmap(), WeightHistogram(), RunSummary()])
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_fedhet.data.datamodule import FederatedDataModule

from . import plots
from ._common import federated_strategy, log_wandb, media_dir, save_png, wandb_image, wandb_loggers

__all__ = ["ParticipationHeatmap", "WeightHistogram", "ExitAccuracyTable", "AccuracyVsSimTime", "RunSummary"]


class _MediaCallback(Callback):
    """Common part: checks the strategy, sends a figure to W&B or to a PNG file."""

    def __init__(self, png: bool | None = None) -> None:
        if png is not None and not isinstance(png, bool):
            raise TypeError(f"png must be None, True or False, got {png!r}")
        self.png = png
        self.written: list[Path] = []  # PNG files written so far

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        federated_strategy(trainer, type(self).__name__)

    def _history(self, trainer: pl.Trainer) -> list[dict]:
        return federated_strategy(trainer, type(self).__name__).history

    def _emit(self, trainer: pl.Trainer, name: str, fig: Any, extra: dict[str, Any] | None = None) -> None:
        """``fig`` as W&B image ``media/<name>`` (plus ``extra`` W&B values) and/or ``<log dir>/media/<name>.png``."""
        if not trainer.is_global_zero:
            return
        rounds_done = len(self._history(trainer))
        has_wandb = bool(wandb_loggers(trainer))
        if has_wandb:
            log_wandb(trainer, {f"media/{name}": wandb_image(fig), **(extra or {})}, rounds_done)
        if self.png or (self.png is None and not has_wandb):
            path = save_png(fig, media_dir(trainer), name)
            if path not in self.written:
                self.written.append(path)


def _num_clients(trainer: pl.Trainer, strategy: Any, history: list[dict]) -> int:
    if strategy.num_clients is not None:
        return int(strategy.num_clients)
    if isinstance(trainer.datamodule, FederatedDataModule):
        return int(trainer.datamodule.num_clients)
    ids = [int(r["available"].max()) for r in history if len(r["available"])]
    return max(ids, default=-1) + 1


class ParticipationHeatmap(_MediaCallback):
    """Client x round heat-map: unavailable / available / selected / update received / update rejected.

    Drawn at the end of ``fit`` (and every ``every_n_rounds`` rounds when set) as ``media/participation``.

    Args:
        every_n_rounds: also draw it every n rounds (``None``: only at the end).
        max_clients: draw the first ``max_clients`` clients (``>= 1``).
        max_rounds: draw the last ``max_rounds`` rounds (``>= 1``).
        png: write ``participation.png`` (``None``: only when no W&B logger is attached).
    """

    def __init__(
        self, every_n_rounds: int | None = None, max_clients: int = 256, max_rounds: int = 1000, png: bool | None = None
    ) -> None:
        super().__init__(png)
        for name, value in (("max_clients", max_clients), ("max_rounds", max_rounds)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if every_n_rounds is not None and int(every_n_rounds) < 1:
            raise ValueError(f"every_n_rounds must be None or >= 1, got {every_n_rounds}")
        self.every_n_rounds = None if every_n_rounds is None else int(every_n_rounds)
        self.max_clients, self.max_rounds = int(max_clients), int(max_rounds)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        history = self._history(trainer)
        if self.every_n_rounds and history and len(history) % self.every_n_rounds == 0:
            if trainer.max_epochs is None or len(history) < trainer.max_epochs:  # the last one is drawn at fit end
                self._draw(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._history(trainer):
            self._draw(trainer)

    def _draw(self, trainer: pl.Trainer) -> None:
        strategy = federated_strategy(trainer, type(self).__name__)
        history = strategy.history
        n = _num_clients(trainer, strategy, history)
        self._emit(trainer, "participation", plots.participation_figure(history, n, self.max_clients, self.max_rounds))


class WeightHistogram(_MediaCallback):
    """Aggregation weights applied to the clients' fresh updates.

    With W&B: a ``wandb.Histogram`` per round (``media/aggregation_weights``) and, at the end, a scatter of every
    weight against its round with the per-round sum (``media/aggregation_weights_plot``). Without W&B: the
    scatter as ``aggregation_weights_plot.png``.

    Args:
        png: write the PNG (``None``: only when no W&B logger is attached).
    """

    def __init__(self, png: bool | None = None) -> None:
        super().__init__(png)
        self._seen = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen = len(self._history(trainer))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        history = self._history(trainer)
        if trainer.is_global_zero and wandb_loggers(trainer):
            import wandb

            for record in history[self._seen :]:
                if record["weights"]:
                    values = [float(w) for w in record["weights"].values()]
                    log_wandb(trainer, {"media/aggregation_weights": wandb.Histogram(values)}, record["round"] + 1)
        self._seen = len(history)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        history = self._history(trainer)
        if history:
            self._emit(trainer, "aggregation_weights_plot", plots.weights_figure(history))


class _ValidationCurve(_MediaCallback):
    """Collects rows at each validation of ``fit`` (not the sanity check)."""

    def __init__(self, png: bool | None = None) -> None:
        super().__init__(png)
        self.rows: list[tuple] = []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows = []

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._collect(trainer, self._history(trainer))

    def _collect(self, trainer: pl.Trainer, history: list[dict]) -> None:
        raise NotImplementedError


class ExitAccuracyTable(_ValidationCurve):
    """Per-exit accuracy of an early-exit model at each validation, as a table and a line plot.

    Reads the logged ``<prefix>_acc_exit<e>`` metrics (``EarlyExitClassifier`` logs them). With W&B: a
    ``wandb.Table`` ``media/exit_accuracy`` with columns round / exit / accuracy, and the plot
    ``media/exit_accuracy_plot``; after ``trainer.test``, the table ``media/test_exit_accuracy``. Without W&B:
    ``exit_accuracy_plot.png``.

    Args:
        prefix: metric prefix of the validation metrics (``"val"`` -> ``val_acc_exit1``, ...).
        png: write the PNG (``None``: only when no W&B logger is attached).
    """

    def __init__(self, prefix: str = "val", png: bool | None = None) -> None:
        super().__init__(png)
        if not re.fullmatch(r"\w+", prefix):
            raise ValueError(f"prefix must be a metric-name prefix such as 'val', got {prefix!r}")
        self.prefix = prefix

    @staticmethod
    def exit_metrics(metrics: dict[str, Any], prefix: str) -> dict[int, float]:
        """``{exit: accuracy}`` from the metrics named ``<prefix>_acc_exit<e>``."""
        pattern = re.compile(rf"{re.escape(prefix)}_acc_exit(\d+)")
        found = {int(m.group(1)): float(v) for k, v in metrics.items() if (m := pattern.fullmatch(k))}
        return dict(sorted(found.items()))

    def _collect(self, trainer: pl.Trainer, history: list[dict]) -> None:
        for exit_, accuracy in self.exit_metrics(trainer.callback_metrics, self.prefix).items():
            self.rows.append((len(history), exit_, accuracy))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.rows:
            rank_zero_warn(
                f"ExitAccuracyTable saw no '{self.prefix}_acc_exit<e>' metrics: log one per exit (EarlyExitClassifier "
                "does) and validate during fit (check_val_every_n_epoch)."
            )
            return
        extra = {}
        if wandb_loggers(trainer):
            import wandb

            extra["media/exit_accuracy"] = wandb.Table(columns=["round", "exit", "accuracy"],
                                                       data=[list(r) for r in self.rows])
        self._emit(trainer, "exit_accuracy_plot", plots.exit_accuracy_figure(self.rows, f"{self.prefix}_acc"), extra)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        found = self.exit_metrics(trainer.callback_metrics, "test")
        if not found or not trainer.is_global_zero or not wandb_loggers(trainer):
            return
        import wandb

        table = wandb.Table(columns=["exit", "accuracy"], data=[[e, a] for e, a in found.items()])
        log_wandb(trainer, {"media/test_exit_accuracy": table}, len(self._history(trainer)))


class AccuracyVsSimTime(_ValidationCurve):
    """A validation metric against rounds and against simulated time (``strategy.history[-1]["sim_time"]``).

    With W&B: a ``wandb.Table`` ``media/<metric>_vs_sim_time`` (round, sim_time, metric), a W&B line chart of it,
    and the figure ``media/<metric>_vs_time``. Without W&B: ``<metric>_vs_time.png``. Simulated time needs a
    latency model (``FedHetStrategy(latency=...)``); without one it is 0 and only the per-round curve is drawn.

    Args:
        metric: the logged validation metric (default ``"val_acc"``).
        png: write the PNG (``None``: only when no W&B logger is attached).
    """

    def __init__(self, metric: str = "val_acc", png: bool | None = None) -> None:
        super().__init__(png)
        self.metric = str(metric)

    def _collect(self, trainer: pl.Trainer, history: list[dict]) -> None:
        metrics = trainer.callback_metrics
        if history and self.metric in metrics:
            self.rows.append((len(history), float(history[-1]["sim_time"]), float(metrics[self.metric])))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.rows:
            rank_zero_warn(f"AccuracyVsSimTime saw no '{self.metric}' at any validation during fit.")
            return
        extra = {}
        if wandb_loggers(trainer):
            import wandb

            table = wandb.Table(columns=["round", "sim_time", self.metric], data=[list(r) for r in self.rows])
            extra[f"media/{self.metric}_vs_sim_time"] = wandb.plot.line(
                table, "sim_time", self.metric, title=f"{self.metric} against simulated time"
            )
        self._emit(trainer, f"{self.metric}_vs_time", plots.accuracy_time_figure(self.rows, self.metric), extra)


class RunSummary(_MediaCallback):
    """End-of-run totals: rounds, updates received / rejected, steps, bytes, simulated time, server memory, and the
    size of the last checkpoint.

    With W&B: the totals in the run summary (``summary/<name>``), a ``wandb.Table`` ``media/run_summary`` and the
    figure ``media/run_summary_plot``. Without W&B: ``run_summary.json`` and ``run_summary_plot.png`` in
    ``<log dir>/media/``. The totals are also printed (``rank_zero_info``) and kept in :attr:`summary`.

    Args:
        png: write the PNG and JSON (``None``: only when no W&B logger is attached).
    """

    def __init__(self, png: bool | None = None) -> None:
        super().__init__(png)
        self.summary: dict[str, Any] = {}

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = federated_strategy(trainer, type(self).__name__)
        history = strategy.history
        model_bytes = sum(t.numel() * t.element_size() for t in pl_module.state_dict().values())
        summary: dict[str, Any] = plots.run_summary(history, strategy.rejected_total, model_bytes)
        note = self._checkpoint_note(trainer, summary)
        summary["checkpoint_note"] = note
        self.summary = summary
        rank_zero_info("Run summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
        if not trainer.is_global_zero:
            return
        loggers = wandb_loggers(trainer)
        extra = {}
        if loggers:
            import wandb

            for logger in loggers:
                logger.experiment.summary.update({f"summary/{k}": v for k, v in summary.items()})
            extra["media/run_summary"] = wandb.Table(columns=["name", "value"],
                                                     data=[[k, str(v)] for k, v in summary.items()])
        self._emit(trainer, "run_summary_plot", plots.summary_figure(summary, history, note), extra)
        if self.png or (self.png is None and not loggers):
            path = media_dir(trainer) / "run_summary.json"
            path.write_text(json.dumps(summary, indent=2))
            self.written.append(path)

    @staticmethod
    def _checkpoint_note(trainer: pl.Trainer, summary: dict[str, Any]) -> str:
        checkpoint = trainer.checkpoint_callback
        path = None
        if checkpoint is not None:
            path = checkpoint.last_model_path or checkpoint.best_model_path
        if path and Path(path).is_file():
            size = Path(path).stat().st_size
            summary["checkpoint_bytes"] = size
            return f"checkpoint {Path(path).name}: {plots.format_bytes(size)}"
        # What a checkpoint would hold: the model, the server's global vector and per-client memories, the history.
        estimate = 2 * summary["model_bytes"] + summary["server_memory_bytes"]
        return f"no checkpoint saved (one would take about {plots.format_bytes(estimate)} + history)"
