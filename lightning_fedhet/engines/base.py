"""The Engine protocol: how one round's local training runs, driven by Lightning's loop.

The strategy picks one engine at setup and forwards Lightning's hooks to it; the engine asks the
:class:`~lightning_fedhet.server.Server` for the round's plan, starts every client through
:meth:`Server.start_client` (global weights, the rule's per-client config, optimizer state), trains, and hands each
trained client's delta to :meth:`Server.submit`. Lightning iterates :meth:`Engine.round_batches`; each item is one
Lightning step (one client's local step for the sequential engine, the whole round of the cohort for vmap).

Engines count the round's steps themselves (``on_batch_start``/``on_batch_end`` pairs) instead of trusting
Lightning's ``batch_idx``, which does not restart at 0 when a fit resumes inside an epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_fedhet.federation import RoundPlan
from lightning_fedhet.flat import FlatModel
from lightning_fedhet.server import ClientStart, Server

BatchToDevice = Callable[[Any], Any]


class EngineBatch:
    """A Lightning batch that the engine moves to the device itself, piece by piece, as it uses it.

    The strategy's ``batch_to_device`` passes it through unchanged; the engine sends each piece through the
    strategy's usual transfer (the module's ``transfer_batch_to_device`` and ``on_after_batch_transfer`` hooks), so
    a round's data never has to be on the device all at once.
    """


class Engine:
    """Base class of the engines. Subclasses implement :meth:`_round_batches`, :meth:`on_batch_start`,
    :meth:`training_step` and :meth:`on_batch_end`.

    Lifecycle (the strategy calls these)::

        engine.setup(module, optimizers, server, to_device)   # once per fit
        for batch in engine.round_batches():                  # Lightning's epoch = one round
            engine.on_batch_start()
            out = engine.training_step(default_step, batch, batch_idx)
            engine.on_batch_end(out)                          # submits finished clients, closes the round
        engine.finish_partial_round()                         # the epoch ended before the round did
    """

    #: the name users pass as ``FedHetStrategy(engine=...)``
    name = "base"
    #: whether the engine can restore each client's own optimizer state (``optimizer_state="persist"``)
    keeps_client_optimizer_state = True
    #: whether the engine takes ``compile=`` (a compiled step)
    supports_compile = False
    #: whether a whole round is one Lightning step (else one client's local step is)
    one_step_per_round = False

    def __init__(self, compile: bool | str = False) -> None:
        self.check_compile(compile)
        self.compile = compile
        self.module: pl.LightningModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.server: Server | None = None
        self.flat: FlatModel | None = None
        self.to_device: BatchToDevice = _unchanged  # a module-level function: spawn-launched strategies pickle it
        self.step = 0
        #: the part of the open round's plan this engine executes (the whole plan in one process)
        self.plan: RoundPlan | None = None
        self._held_local: Tensor | None = None
        # (scale, [[lr of each param group] of each optimizer] before scaling) while a round runs with a scaled lr
        self._lr_scaled: tuple[float, list[list[float]]] | None = None

    @classmethod
    def check_compile(cls, compile: bool | str) -> None:
        """Refuse a ``compile=`` this engine does not take (checked when a spec names the engine, before any work)."""
        if compile and not cls.supports_compile:
            raise ValueError(f"compile={compile!r} is not supported by engine={cls.name!r}; use engine='vmap'")

    # ------------------------------------------------------------------ setup
    def setup(
        self,
        module: pl.LightningModule,
        optimizers: list[torch.optim.Optimizer],
        server: Server,
        flat: FlatModel,
        to_device: BatchToDevice,
    ) -> None:
        """Bind to the fit's module, optimizers and server; refuse here what the engine cannot simulate."""
        self.module, self.optimizers, self.server, self.flat, self.to_device = (
            module,
            optimizers,
            server,
            flat,
            to_device,
        )
        self.step = 0
        self.flat.set(server.global_vector)

    def check_lr_schedulers(self, intervals: list[str]) -> None:
        """Refuse learning-rate schedules the engine cannot follow; ``intervals`` are the schedulers' ``"step"`` /
        ``"epoch"`` settings from ``configure_optimizers``. Every schedule is followed by default."""

    # ------------------------------------------------------------------ one round
    def round_batches(self) -> Iterator:
        """Open the next round and return what Lightning iterates for it (nothing if nobody trains)."""
        server = self.server
        if server.round_open:
            self.finish_partial_round()
        plan = self.plan = server.begin_round(server.next_round, probe=self.probe_losses)
        self.step = 0
        self.scale_client_lr()
        self._begin(plan)
        if plan.num_steps == 0:
            self.close_round()
            return iter(())
        return self._round_batches(plan)

    def _begin(self, plan) -> None:
        """Engine-specific start of a round (after the plan is drawn)."""

    def _round_batches(self, plan) -> Iterator:
        raise NotImplementedError

    def on_batch_start(self) -> None:
        raise NotImplementedError

    def training_step(self, default_step: Callable[..., Any], batch: Any, batch_idx: int) -> Any:
        """Run one Lightning step; ``default_step`` is Lightning's own ``training_step`` call."""
        return default_step(batch, batch_idx)

    def on_batch_end(self, output: Any) -> None:
        raise NotImplementedError

    def close_round(self, complete: bool = True) -> None:
        """Close the server's round and load the new global model (integer buffers included) into the module."""
        self.restore_client_lr()
        self.flat.set(self.server.close_round(complete))
        if self.server.global_ints.numel():
            self.flat.set_ints(self.server.global_ints)

    def finish_partial_round(self) -> None:
        """The epoch ended (``max_steps``, ``limit_train_batches``, ...) before every client finished: close the
        round with the updates that had arrived (unfinished clients count as not arrived)."""
        if self.server is not None and self.server.round_open:
            self._held_local = None
            self.close_round(complete=False)

    # ------------------------------------------------------------------ the rule's learning-rate multiplier
    def scale_client_lr(self) -> None:
        """Multiply every optimizer's ``lr`` by the rule's ``client_lr_scale`` for the round just opened (FedACS's
        ``calibrate="client"``: the paper's ``eta`` of this round); :meth:`restore_client_lr` undoes it. The scale
        is the same for every client of a round, so every engine applies it at the round's start (the cohort
        engines read ``lr`` there)."""
        scale = float(self.server.algorithm.client_lr_scale)
        if scale == 1.0:
            return
        before = [[float(group["lr"]) for group in optimizer.param_groups] for optimizer in self.optimizers]
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * scale
        self._lr_scaled = (scale, before)

    def restore_client_lr(self) -> None:
        """Give every ``lr`` back its value before :meth:`scale_client_lr` (exactly, unless a scheduler changed it
        inside the round: then the scheduler's value divided by the scale)."""
        if self._lr_scaled is None:
            return
        scale, before = self._lr_scaled
        for optimizer, lrs in zip(self.optimizers, before):
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr if group["lr"] == lr * scale else group["lr"] / scale
        self._lr_scaled = None

    # ------------------------------------------------------------------ the global model for inspection
    def hold_global(self) -> None:
        """Mid-round (validation inside an epoch): put ``w_t`` into the module, keeping the client's weights."""
        if self.server is not None and self.server.round_open and self._held_local is None:
            self._held_local = self.flat.get(self.server.global_vector.dtype)
            self.flat.set(self.server.global_vector)

    def release_global(self) -> None:
        """Give the module back the client weights :meth:`hold_global` kept."""
        if self._held_local is not None:
            self.flat.set(self._held_local)
            self._held_local = None

    # ------------------------------------------------------------------ shared pieces
    def apply_config(self, config: dict) -> None:
        """Pass the rule's per-client config (Fed-CIS's exit) to the module's ``configure_client(**config)``."""
        apply_client_config(self.module, self.server.algorithm, config)

    def load_client(self, start: ClientStart) -> None:
        """Put the global model, the rule's config and the client's optimizer state into the module."""
        self.flat.set(start.global_vector)
        if start.int_buffers is not None and start.int_buffers.numel():
            self.flat.set_ints(start.int_buffers)
        self.apply_config(start.config)
        for i, optimizer in enumerate(self.optimizers):
            optimizer.state.clear()
            if start.optimizer_state is not None:
                import_optimizer_state(optimizer, start.optimizer_state[i])

    def probe_losses(self, round: int, available: Tensor) -> Tensor:
        """The one-batch training loss of every available client at the global model (see :func:`probe_losses`)."""
        return probe_losses(self.module, self.flat, self.server, self.to_device, round, available)


def apply_client_config(module: pl.LightningModule, algorithm: Any, config: dict) -> None:
    """Pass the rule's per-client config (Fed-CIS's exit) to the module's ``configure_client(**config)``."""
    if not config:
        return
    configure = getattr(module, "configure_client", None)  # the user's module, not one of ours
    if configure is None:
        raise TypeError(
            f"{type(algorithm).__name__} sends {sorted(config)} to each client: the LightningModule "
            "must define configure_client(**config) (EarlyExitClassifier does)"
        )
    configure(**config)


def probe_losses(
    module: pl.LightningModule, flat: FlatModel, server: Server, to_device: BatchToDevice, round: int, available: Tensor
) -> Tensor:
    """The one-batch training loss of every available client at the global model (float64 ``[N]``, NaN for the
    others), for rules that select on it (CA-Fed, thesis Algorithm 3 line 3). Loads ``w_t`` into ``module``; no
    parameter changes."""
    losses = torch.full((server.num_clients,), float("nan"), dtype=torch.float64)
    flat.set(server.global_vector)
    with torch.no_grad(), logging_disabled(module):
        for client in torch.nonzero(available & server.planner.has_data).flatten().tolist():
            batch = to_device(server.streams.batch(server.streams.probe_indices(round, client)))
            out = module.training_step(batch, 0)
            losses[client] = float(out["loss"] if isinstance(out, dict) else out)
    return losses


#: ``self.log(..., reduce_fx=...)`` values an engine that aggregates a round's logged values itself can follow
_LOG_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def log_reduction(name: str, reduce_fx: Any = "mean") -> str:
    """The reduction (``"mean"``, ``"sum"``, ``"max"`` or ``"min"``) that ``self.log(name, ..., reduce_fx=...)`` asks
    for, given by name or as a function (``torch.max``); anything else raises ``ValueError`` naming the call."""
    reduction = _LOG_REDUCTIONS.get(reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", ""))
    if reduction is None:
        raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): use 'mean', 'sum', 'max' or 'min'")
    return reduction


def reduce_logged(values: Tensor, reduction: str) -> Tensor:
    """``values`` (any shape, at least one element) reduced to a scalar by ``reduction`` (see :func:`log_reduction`)."""
    return {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}[reduction](values)


def _unchanged(batch: Any) -> Any:
    return batch


class _NoLog:
    """Stands in for ``LightningModule.log`` where Lightning's loop is not running (probes)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def logging_disabled(module: pl.LightningModule):
    """Silence ``self.log`` inside ``training_step`` while the engine calls it outside Lightning's loop."""
    original = module.log
    module.log = _NoLog()
    try:
        yield
    finally:
        module.log = original


def export_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """The optimizer's per-parameter state keyed by parameter position (so it survives a checkpoint)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: _clone(optimizer.state[p]) for i, p in enumerate(params) if p in optimizer.state}


def import_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[int, dict]) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, s in state.items():
        optimizer.state[params[i]] = _clone(s)


def _clone(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}
