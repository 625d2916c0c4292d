"""``engine="auto"``: the vmap engine (compiled where it pays) when the run passes its checks, else the sequential one.

The choice is made once per fit, when the fit's server exists (:func:`decide`, which the strategy reaches through
:func:`lightning_fedhet.engines.registry.choose`), in two steps, and the strategy says it once (``rank_zero_info``)
with its reason:

1. :func:`choose_engine`, from what the fit knows (:class:`FitFacts`): the module, its optimizer and learning-rate
   schedulers, the rule, ``optimizer_state``, an int ``val_check_interval`` counted inside each epoch, the device and
   the number of rounds. Anything the vmap engine refuses at setup picks ``sequential``.
2. :func:`vmap_trial` on the first round's data: one vmapped gradient of ``training_step`` on one client's real
   mini-batch, on copies of the parameters and buffers (nothing of the run changes). If ``torch.func`` cannot
   transform the step (data-dependent Python control flow, ``backward`` inside ``training_step``, ...), ``sequential``.

Whether vmap pays was measured (``docs/performance.md``): on a GPU a cohort in lock-step is always the fast path; on a
CPU it is for models whose steps are small (logistic regression: 6x the sequential engine), not for convolutional
networks, whose batched CPU kernels gain nothing over one client at a time (the Fashion-MNIST CNN: 0.8-1.1x), so
``auto`` keeps such a model on the sequential engine there. Compiling pays on a GPU, and on a CPU for models without
convolutions when the run is long enough to repay the compilation (:data:`COMPILE_MIN_ROUNDS` rounds); an explicit
``compile=True/False`` is followed whenever vmap is picked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_fedhet.engines._compiled import (
    LogCollector,
    StepModule,
    VmapUnsupported,
    make_grad_step,
    make_loss,
)
from lightning_fedhet.engines.cohort_checks import check_vmap_fit
from lightning_fedhet.engines.layout import StateLayout

#: a CPU run compiles the cohort step only from this many rounds on (compiling a small model costs seconds)
COMPILE_MIN_ROUNDS = 200


@dataclass(frozen=True)
class EngineChoice:
    """What ``engine="auto"`` picked: ``name`` (``"sequential"`` or ``"vmap"``), ``compile`` and why."""

    name: str
    compile: bool | str
    reason: str

    def describe(self) -> str:
        compiled = " with compile=" + repr(self.compile) if self.name == "vmap" and self.compile else ""
        return f"FedHetStrategy(engine='auto') trains with engine={self.name!r}{compiled}: {self.reason}"


@dataclass(frozen=True)
class FitFacts:
    """What the engine choice reads of a Lightning fit (the strategy gathers it once)."""

    module: nn.Module
    optimizers: Sequence[torch.optim.Optimizer]
    #: each learning-rate scheduler's ``interval`` (``"step"`` or ``"epoch"``)
    scheduler_intervals: Sequence[str]
    #: ``Trainer(val_check_interval=N)`` when Lightning counts ``N`` steps inside each epoch, else ``None``
    val_interval_inside_epoch: int | None
    device: torch.device
    #: ``Trainer(max_epochs=...)``: the fit's rounds (``None`` or negative: unbounded)
    rounds: int | None
    #: the strategy's batch transfer (the module's transfer hooks)
    to_device: Callable[[Any], Any]


def decide(fit: FitFacts, server: Any, compile: bool | str | None) -> EngineChoice:
    """``engine="auto"`` for a fit whose ``server`` (:class:`~lightning_fedhet.server.Server`) is built: step 1 from
    ``fit`` and the server's rule and ``optimizer_state``, then step 2 on the server's first client with data
    (``compile=None`` lets step 1 decide whether to compile)."""
    choice = choose_engine(
        fit.module,
        fit.optimizers,
        fit.scheduler_intervals,
        sends_client_config=server.algorithm.sends_client_config,
        optimizer_state=server.optimizer_state,
        val_interval_inside_epoch=fit.val_interval_inside_epoch,
        device=fit.device,
        rounds=fit.rounds,
        compile=compile,
        rule=type(server.algorithm).__name__,
    )
    if choice.name == "vmap":
        batch = trial_batch(server.streams, server.planner.has_data)
        cause = None if batch is None else vmap_trial(fit.module, batch, fit.to_device)
        if cause is not None:
            choice = EngineChoice("sequential", False, cause)
    return choice


def choose_engine(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    scheduler_intervals: Sequence[str],
    *,
    sends_client_config: bool,
    optimizer_state: str,
    val_interval_inside_epoch: int | None,
    device: torch.device,
    rounds: int | None,
    compile: bool | str | None,
    rule: str = "the rule",
) -> EngineChoice:
    """The engine for a fit (step 1 of the module docstring); ``compile=None`` lets the choice decide."""

    def sequential(reason: str) -> EngineChoice:
        return EngineChoice("sequential", False, reason)

    if not getattr(module, "automatic_optimization", True):  # the user's module, not one of ours
        return sequential("the module uses manual optimisation")
    try:
        check_vmap_fit(module, optimizers, optimizer_state=optimizer_state, sends_client_config=sends_client_config,
                       rule=rule)
    except VmapUnsupported as err:  # the engine's own setup check: auto and the engine cannot disagree
        return sequential(_cause(err))
    if "step" in scheduler_intervals:
        return sequential("a learning-rate scheduler steps every local step (interval='step')")
    if val_interval_inside_epoch is not None and val_interval_inside_epoch > 1:
        return sequential(
            f"val_check_interval={val_interval_inside_epoch} is counted inside each round, which vmap runs as one step"
        )
    convolutional = any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())
    if device.type == "cpu" and convolutional:
        return sequential(
            "the model has convolutions and trains on a CPU, where a cohort's batched convolutions are no faster than "
            "one client at a time (vmap pays on a GPU, or for models without convolutions)"
        )
    if compile is None:
        long_run = rounds is None or rounds < 0 or rounds >= COMPILE_MIN_ROUNDS
        compile = device.type == "cuda" or (not convolutional and long_run)
    where = "on a GPU" if device.type == "cuda" else "on a CPU for a model without convolutions"
    return EngineChoice("vmap", compile, f"the model passes vmap's checks and a cohort in lock-step pays {where}")


def vmap_trial(module: nn.Module, batch: Any, to_device: Callable[[Any], Any]) -> str | None:
    """Step 2 of the module docstring: ``None`` when ``torch.func`` transforms ``training_step`` on ``batch`` (one
    client's mini-batch, stacked ``[1, B, ...]``), else the cause. Works on copies: the module does not change."""
    layout = StateLayout(module)
    floats, ints = layout.current()
    rows = floats.unsqueeze(0)
    params = StateLayout.split(rows[:, : layout.num_parameters], layout.params)
    buffers = StateLayout.split(rows[:, layout.num_parameters :], layout.float_buffers)
    buffers.update(StateLayout.split(ints.unsqueeze(0), layout.int_buffers))
    buffers = {name: buffers[name] for name, _ in module.named_buffers()}
    collector = LogCollector()
    original = module.log
    module.log = collector
    try:
        step = make_grad_step(make_loss(StepModule(module), collector))
        step(params, buffers, to_device(batch), 0, torch.ones(1, dtype=torch.bool, device=rows.device))
    except VmapUnsupported as err:
        return _cause(err)
    except RuntimeError as err:  # torch.func's refusals are RuntimeErrors
        return f"torch.func could not transform training_step ({str(err).strip().splitlines()[0][:300]})"
    finally:
        module.log = original
    return None


def trial_batch(streams: Any, has_data: np.ndarray) -> Any | None:
    """The first mini-batch of the first client holding data, stacked ``[1, B, ...]`` (``None`` if nobody has data)."""
    clients = np.flatnonzero(has_data)
    if clients.size == 0:
        return None
    indices = streams.probe_indices(0, int(clients[0]))
    return streams.stacked_batch(indices[None, :])


def _cause(err: VmapUnsupported) -> str:
    text = str(err).removeprefix("engine='vmap' cannot run this: ")
    return text.removesuffix(". Use engine='sequential' instead.")
