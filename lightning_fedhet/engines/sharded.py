"""An engine on one process's part of every round, for rounds split over several processes (FedHetDDPStrategy).

Every process draws the same plan, trains the clients :func:`~lightning_fedhet.distributed.place_clients` gives it
with the ordinary engine (sequential or vmap), and then runs *padding* steps until it has run as many Lightning
steps as the busiest process: Lightning exchanges a flag between the processes at every step, so every process must
run the same number. A padding step runs no user code and changes nothing (its batch is :data:`PADDING`). At the
round's last step, on every process at once, the processes merge their partial sums
(:meth:`~lightning_fedhet.distributed.ProcessGroupComm.merge`) and close the round identically.

Logging: a per-step ``self.log(..., sync_dist=True)`` is a collective that a padding or idle process would never
join. Values the user's ``training_step`` logs are therefore kept as per-round aggregates (mean weighted by batch
size, sum, max or min, as ``reduce_fx`` asks), merged with the round, and logged once per round (``on_epoch``) with
the same value on every process: the value over every client's steps, on every process.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_fedhet.distributed import ProcessGroupComm, local_view, place_clients
from lightning_fedhet.engines.base import Engine, log_reduction
from lightning_fedhet.engines.sequential import SequentialEngine
from lightning_fedhet.engines.vmap import VmapEngine
from lightning_fedhet.federation import RoundPlan


class Padding:
    """The batch of a padding step (this process has no more local steps in the round)."""

    def __repr__(self) -> str:
        return "PADDING"


PADDING = Padding()


class RoundLogs:
    """Stands in for ``LightningModule.log`` during a real step: keeps each name's aggregate over the round.

    ``aggregates()`` is ``{name: (reduction, value, count, prog_bar, logger)}`` where ``value`` is the sum of
    ``value * batch_size`` (mean), the sum (sum) or the extreme (max/min), and ``count`` the summed batch sizes.
    """

    def __init__(self) -> None:
        self.batch: Any = None
        self._values: dict[str, list] = {}

    def clear(self) -> None:
        self._values = {}

    def __call__(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        *args: Any,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        reduction = log_reduction(name, reduce_fx)
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) needs a scalar, got a tensor of shape {tuple(value.shape)}")
            number = float(value.detach())
        elif isinstance(value, (int, float)):
            number = float(value)
        else:
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) in training_step: FedHetDDPStrategy aggregates logged "
                "values over each round across processes, so it needs a number or a scalar tensor (log the "
                "metric's value, e.g. a torchmetrics.functional result, not a Metric object)"
            )
        size = int(batch_size) if batch_size is not None else extract_batch_size(self.batch)
        entry = self._values.get(name)
        if entry is None:
            start = {"mean": 0.0, "sum": 0.0, "max": -float("inf"), "min": float("inf")}[reduction]
            entry = self._values[name] = [reduction, start, 0, bool(prog_bar), logger]
        if entry[0] != reduction:
            raise ValueError(f"self.log({name!r}) was called with reduce_fx {entry[0]!r} and {reduction!r} in a round")
        if reduction == "mean":
            entry[1] += number * size
        elif reduction == "sum":
            entry[1] += number
        else:
            entry[1] = max(entry[1], number) if reduction == "max" else min(entry[1], number)
        entry[2] += size

    def aggregates(self) -> dict[str, tuple]:
        return {name: tuple(entry) for name, entry in self._values.items()}


def combine_logs(per_process: list[dict[str, tuple]]) -> dict[str, tuple[float, int, str, bool, bool | None]]:
    """Every process's :meth:`RoundLogs.aggregates` (rank order) -> ``{name: (value, count, reduction, prog_bar,
    logger)}``, names in sorted order, the same on every process."""
    combined: dict[str, list] = {}
    for aggregates in per_process:
        for name, (reduction, value, count, prog_bar, logger) in aggregates.items():
            entry = combined.setdefault(name, [reduction, None, 0, prog_bar, logger])
            if entry[1] is None:
                entry[1] = value
            elif reduction in ("mean", "sum"):
                entry[1] += value
            else:
                entry[1] = max(entry[1], value) if reduction == "max" else min(entry[1], value)
            entry[2] += count
    out = {}
    for name in sorted(combined):
        reduction, value, count, prog_bar, logger = combined[name]
        if reduction == "mean":
            value = value / count if count else float("nan")
        out[name] = (value, count, reduction, prog_bar, logger)
    return out


class ShardedEngine(Engine):
    """Runs the inner engine (the next class in the method resolution order) on this process's part of each round.

    Args:
        comm: the process group's collectives.
        placement: ``"balanced"`` or ``"by_client"`` (see :mod:`lightning_fedhet.distributed`).
        compile: passed to the inner engine (``engine="vmap"`` only).
    """

    #: whether a real step trains the LightningModule's own parameters with the user's optimizer (the vmap engine
    #: steps its own stacked copies instead, so Lightning's optimizer step must not run)
    trains_module: ClassVar[bool] = True

    def __init__(self, comm: ProcessGroupComm, placement: str = "balanced", compile: bool | str = False) -> None:
        super().__init__(compile)
        self.comm = comm
        self.placement = placement
        self.padding = False
        self.logs = RoundLogs()
        self._own_steps = 0
        self._round_steps = 0
        self._steps_done = 0

    def lightning_steps(self, plan: RoundPlan) -> int:
        """Lightning steps the inner engine runs for ``plan`` (one per local step of each client)."""
        return plan.num_steps

    @property
    def steps_module_optimizer(self) -> bool:
        """Whether Lightning's optimizer step must run in the current step (a real step of a module-training
        engine); padding steps and vmap steps change nothing through it."""
        return self.trains_module and not self.padding

    # ------------------------------------------------------------------ one round
    def round_batches(self) -> Iterator:
        server = self.server
        if server.round_open:
            self.finish_partial_round()
        plan = server.begin_round(server.next_round, probe=self.probe_losses)
        parts = place_clients(plan, self.comm.world_size, self.placement)
        views = [local_view(plan, part) for part in parts]
        counts = [self.lightning_steps(view) for view in views]
        self.plan = views[self.comm.rank]
        self.step = self._steps_done = 0
        self._own_steps, self._round_steps = counts[self.comm.rank], max(counts)
        self.padding = False
        self.logs.clear()
        self.scale_client_lr()
        self._begin(self.plan)
        if self._round_steps == 0:
            self._merge_and_close(complete=True)
            return iter(())
        own = self._round_batches(self.plan) if self._own_steps else iter(())
        return itertools.chain(own, itertools.repeat(PADDING, self._round_steps - self._own_steps))

    def on_batch_start(self) -> None:
        self.padding = self._steps_done >= self._own_steps
        if not self.padding:
            super().on_batch_start()

    def training_step(self, default_step, batch: Any, batch_idx: int) -> Any:
        if self.padding:
            return None
        original = self.module.log
        self.logs.batch = batch
        self.module.log = self.logs
        try:
            return super().training_step(default_step, batch, batch_idx)
        finally:
            self.module.log = original
            self.logs.batch = None

    def on_batch_end(self, output: Any) -> None:
        if not self.padding:
            super().on_batch_end(output)  # submits the clients that finished; the round closes below
        self._steps_done += 1
        if self._steps_done == self._round_steps:
            self._merge_and_close(complete=True)

    def close_round(self, complete: bool = True) -> None:
        """The inner engine finished its part; the round closes at the last step of every process."""

    def finish_partial_round(self) -> None:
        if self.server is not None and self.server.round_open:
            self._held_local = None
            self._merge_and_close(complete=False)

    def abandon_round(self) -> None:
        """After an exception (other processes may not reach a collective): put the global model back, no merge."""
        if self.server is not None and self.server.round_open:
            self._held_local = None
            self.restore_client_lr()
            self.flat.set(self.server.global_vector)

    def _merge_and_close(self, complete: bool) -> None:
        per_process = self.comm.merge(self.server.round_shares(), self.logs.aggregates())
        super().close_round(complete)
        self.padding = False
        self._emit_logs(combine_logs(per_process))

    def _emit_logs(self, combined: dict[str, tuple]) -> None:
        for name, (value, count, reduction, prog_bar, logger) in combined.items():
            try:
                self.module.log(
                    name,
                    torch.tensor(value, dtype=torch.float32),
                    prog_bar=prog_bar,
                    logger=logger,
                    on_step=False,
                    on_epoch=True,
                    reduce_fx=reduction,
                    sync_dist=False,  # every process logs the same merged value
                    batch_size=max(int(count), 1),
                )
            except MisconfigurationException as err:  # a round closed where Lightning allows no logging
                warnings.warn(f"round metric {name!r} not logged: {err}", stacklevel=2)


class ShardedSequentialEngine(ShardedEngine, SequentialEngine):
    """The sequential engine on this process's clients."""


class ShardedVmapEngine(ShardedEngine, VmapEngine):
    """The vmap engine on this process's clients (one lock-step cohort per process)."""

    trains_module = False

    def lightning_steps(self, plan: RoundPlan) -> int:
        return 1 if bool(plan.trained.any()) else 0  # one Lightning step is the whole round


def sharded_engine(engine: type[Engine]) -> type[ShardedEngine]:
    """The class that runs ``engine`` on one process's part of every round: the :class:`ShardedEngine` mixed with it."""
    for sharded in ShardedEngine.__subclasses__():
        if engine in sharded.__bases__:
            return sharded
    raise TypeError(f"engine={engine.name!r} has no form for several processes (no ShardedEngine subclass mixes it in)")
