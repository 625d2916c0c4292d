"""Round progress: a progress bar that counts rounds, and a plain-text line per round for logs.

* :class:`RoundProgressBar` is Lightning's ``TQDMProgressBar`` with one bar for the whole run: its total is
  ``trainer.max_epochs`` (one epoch = one round) and its postfix shows the last round's counts
  (available / selected / received clients, local steps) next to the logged progress-bar metrics.
* :class:`RoundPrinter` prints one labelled line per round (or every n rounds) for CI logs, notebooks and
  ``nohup`` runs; with a progress bar attached it prints above the bar, not on its line.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf
from typing_extensions import override

from ._common import federated_strategy

__all__ = ["RoundPrinter", "RoundProgressBar", "round_postfix"]


def round_postfix(record: dict) -> dict[str, int]:
    """The last round's counts shown by :class:`RoundProgressBar`."""
    postfix = {
        "available": len(record["available"]),
        "selected": len(record["selected"]),
        "received": len(record["received"]),
        "steps": int(sum(record["local_steps"].values())),
    }
    if len(record["rejected"]):
        postfix["rejected"] = len(record["rejected"])
    return postfix


class RoundProgressBar(TQDMProgressBar):
    """A TQDM progress bar over rounds: ``Rounds  12/80 [..., available=10, selected=10, received=9, steps=100]``.

    The bar advances once per round (a Lightning epoch), not per local step, so its total is
    ``trainer.max_epochs`` however many clients and steps a round has. Validation keeps Lightning's own
    transient bar below it. Args as :class:`~lightning.pytorch.callbacks.TQDMProgressBar` (``leave`` is
    ignored: there is one bar for the whole run).
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=False)
        self._round_postfix: dict[str, int] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        federated_strategy(trainer, type(self).__name__)

    @property
    @override
    def train_description(self) -> str:
        return "Rounds"

    @override
    def init_train_tqdm(self) -> Tqdm:
        """The round bar: total ``max_epochs`` (``None`` when unbounded), starting at the rounds already done."""
        trainer = self.trainer
        total = None if trainer.max_epochs in (None, -1) else convert_inf(trainer.max_epochs)
        return Tqdm(
            desc=self.train_description,
            total=total,
            initial=trainer.current_epoch,  # a resumed run starts at the rounds already done
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self._round_postfix = {}

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        pass  # one bar for all rounds: nothing to reset

    @override
    def on_train_batch_end(self, *_: Any) -> None:
        pass  # the bar counts rounds, not local steps

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        history = federated_strategy(trainer, type(self).__name__).history
        if history:
            self._round_postfix = round_postfix(history[-1])
        bar = self.train_progress_bar
        if not bar.disable:
            bar.n = trainer.current_epoch + 1
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {**self._round_postfix, **super().get_metrics(trainer, pl_module)}


class RoundPrinter(Callback):
    """Prints one labelled line per federated round (one Lightning epoch).

    Example output::

        round    5/40 | available 100 | selected 10 | received 10 | local steps 200 | val_acc 0.7449 | wall 22.6 s

    ``rejected`` (updates rejected as non-finite) and ``sim`` (simulated seconds, with a latency model) appear
    when non-zero. With a progress bar attached the line is printed above the bar.

    Args:
        metrics: logged metric names to show when this round validated (validation may run only every
            ``check_val_every_n_epoch`` rounds).
        every_n_rounds: print every n-th round (and always the last one).
    """

    def __init__(self, metrics: tuple[str, ...] = ("val_acc", "val_loss"), every_n_rounds: int = 1) -> None:
        if isinstance(every_n_rounds, bool) or int(every_n_rounds) != every_n_rounds or every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be an integer >= 1, got {every_n_rounds!r}")
        self.metrics = tuple(metrics)
        self.every_n_rounds = int(every_n_rounds)
        self._start = 0.0
        self._validated = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        federated_strategy(trainer, type(self).__name__)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validated = not trainer.sanity_checking

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        history = federated_strategy(trainer, type(self).__name__).history
        if not history:
            return
        record = history[-1]
        round_no = record["round"] + 1
        last = trainer.max_epochs is not None and round_no >= trainer.max_epochs
        if round_no % self.every_n_rounds and not last:
            self._validated = False
            return
        parts = [
            f"round {round_no:>4}/{trainer.max_epochs}",
            f"available {len(record['available'])}",
            f"selected {len(record['selected'])}",
            f"received {len(record['received'])}",
        ]
        if len(record["rejected"]):
            parts.append(f"rejected {len(record['rejected'])}")
        parts.append(f"local steps {sum(record['local_steps'].values())}")
        metrics = trainer.callback_metrics
        for name in self.metrics:
            if name in metrics and self._validated:
                parts.append(f"{name} {float(metrics[name]):.4f}")
        if record["sim_time"]:
            parts.append(f"sim {record['sim_time']:.1f} s")
        parts.append(f"wall {time.perf_counter() - self._start:.1f} s")
        self._validated = False
        line = " | ".join(parts)
        bar = trainer.progress_bar_callback
        if bar is not None and bar.is_enabled:
            bar.print(line)  # above the bar (tqdm.write), never on its line
        else:
            print(line, flush=True)
