"""The vmap cohort engine: a whole round's cohort trains at once with ``torch.func``.

One Lightning step is one whole round: :meth:`VmapEngine.training_step` runs every local step of the cohort (a
:class:`CohortRound` yields them one at a time). So ``trainer.global_step``, ``max_steps`` and an integer
``val_check_interval`` count rounds (the interval with ``check_val_every_n_epoch=None``; without it the strategy
refuses an interval above 1, which Lightning would count inside the one-step epoch and never reach), and Lightning's
per-step loop (hooks, closure, optimizer wrapper: about 0.4 ms per step on a 2-core CPU) runs once per round
instead of once per local step.

Each client's parameters are one row of stacked tensors ``[C, *shape]``. One local step of the cohort is a
single ``vmap(grad_and_value(training_step))`` call over the stacked parameters and the stacked client
batches ``[C, B, ...]``, followed by one step of the user's optimizer class on the stacked tensors. Because
the supported optimizers (SGD, Adam, AdamW, RMSprop, Adagrad) update every element independently, stepping
the stacked tensors is the same as stepping each client's copy with its own state; their one scalar per
tensor (Adam's step count) is shared, which is exact because every client still training has taken the same
number of steps. Clients with fewer local steps than the round's maximum are masked so that they stay at their
last real step: uncompiled, their rows (parameters and optimizer state) are put back after each step; compiled
(``compile=True``, see ``_compiled.py``), the update is ``torch.where(active, new, old)`` inside the graph, which
is exact and needs no copies. Multiplying the gradients of finished clients by zero would not be exact: weight
decay and momentum still move the parameters, and Adam's moments still decay.

Buffers are stacked per client too: BatchNorm's running statistics and ``num_batches_tracked`` (and any counter a
``training_step`` keeps) enter ``functional_call`` as each client's own row, the updated rows come back as outputs of
the vmapped step (``torch.where(active, new, old)`` keeps a finished client's rows), and each client's change goes
to the server with its parameters: floating buffers are averaged there with sample weights and integer buffers move
by the rounded mean change, exactly as under the sequential engine.

Each cohort sums its clients' training losses as a tensor (:meth:`VmapCohort.mean_losses`), so an engine can read
them once per round instead of converting a value per client per step.

The round's cohorts can hold clients of several federations at once (:func:`build_groups` takes ``(server, plan)``
pairs, each row starts from its own federation's global state and goes back to its own server): that is how
:mod:`lightning_fedhet.multiseed` runs many seeds of one configuration as one batched computation.

Limits (each raises :class:`VmapUnsupported` naming the cause and the ``engine="sequential"`` fallback):
BatchNorm with ``momentum=None`` (a cumulative average), optimizers whose state is not elementwise (LBFGS, ...),
per-client persistent optimizer state, data-dependent Python control flow in ``training_step`` (caught when
``torch.func`` refuses it), manual optimization, learning-rate schedulers with ``interval="step"`` (they would
advance once per round here; ``"epoch"`` schedulers advance once per round under both engines and give the same
run). ``self.log`` inside ``training_step`` works: each logged value is computed per client and step, and the
engine logs, once per round, their reduction as ``reduce_fx`` asks (``"mean"``, ``"sum"``, ``"max"``, ``"min"``;
another reduction raises naming the call), shown where ``prog_bar`` / ``logger`` ask: the epoch value the sequential
engine gives for ``on_epoch=True``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_fedhet.data.streams import stack_batches  # noqa: F401  (re-exported: its earlier home)
from lightning_fedhet.engines._compiled import (
    COMPILE_MODES,
    CompiledEntry,
    LogCollector,
    StepModule,
    VmapUnsupported,
    compiled_entry,
    make_grad_step,
    make_loss,
    step_scalars,
    update_rules,
)
from lightning_fedhet.engines._malloc import keep_freed_memory
from lightning_fedhet.engines.base import Engine, EngineBatch, log_reduction, reduce_logged
from lightning_fedhet.federation import RoundPlan
from lightning_fedhet.server import Server

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)


def check_vmap_support(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`VmapUnsupported` for the cases the engine cannot simulate faithfully."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats and sub.momentum is None:
            # the cumulative average reads 1 / float(num_batches_tracked), a per-client value vmap cannot make a float
            raise VmapUnsupported(
                f"module '{name}' ({type(sub).__name__}) has momentum=None (a cumulative moving average of its "
                "running statistics), whose step size is read per client as a Python float; give it a momentum"
            )
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        raise VmapUnsupported(
            f"optimizer {type(optimizer).__name__} is not one whose state is elementwise "
            f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)})"
        )


class StateLayout:
    """Where a module's state sits in the server's vectors: parameters (``named_parameters`` order) then floating
    buffers (``named_buffers`` order) in the float vector ``[d]``, integer buffers in the int64 vector ``[m]`` (the
    layout of :class:`~lightning_fedhet.flat.FlatModel`)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [(name, p) for name, p in module.named_parameters()]
        buffers = list(module.named_buffers())
        self.float_buffers = [(name, b) for name, b in buffers if torch.is_floating_point(b)]
        self.int_buffers = [(name, b) for name, b in buffers if not torch.is_floating_point(b)]
        self.floats = self.params + self.float_buffers
        self.num_parameters = sum(p.numel() for _, p in self.params)

    def current(self) -> tuple[Tensor, Tensor]:
        """The module's own state: float ``[d]`` and int64 ``[m]`` vectors."""
        with torch.no_grad():
            floats = torch.cat([t.detach().reshape(-1) for _, t in self.floats])
            ints = [t.detach().reshape(-1).to(torch.int64) for _, t in self.int_buffers]
            return floats, torch.cat(ints) if ints else torch.zeros(0, dtype=torch.int64, device=floats.device)

    @staticmethod
    def split(rows: Tensor, named: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """Stacked tensors ``[C, *shape]`` (fresh storage, the module's dtypes) from flat rows ``[C, sum numel]``."""
        if not named:
            return {}
        chunks = torch.split(rows, [t.numel() for _, t in named], dim=1)
        return {
            name: chunk.reshape(rows.shape[0], *t.shape).to(device=t.device, dtype=t.dtype, copy=True)
            for (name, t), chunk in zip(named, chunks)
        }


class VmapCohort:
    """One round's cohort, trained in lock-step.

    Args:
        module: the user's LightningModule (its ``training_step`` runs on each client's state; its own tensors are not
            changed).
        optimizer: the user's optimizer (class, hyper-parameters and current learning rates are copied).
        clients: the cohort's client ids (length ``C``).
        local_steps: steps each client runs, int ``[C]``.
        starts: each client's starting state, float ``[C, d]`` in :class:`StateLayout` order (parameters, then floating
            buffers); default: the module's current state for every client.
        int_starts: each client's integer buffers, int64 ``[C, m]``; default: the module's.
        compile: ``False`` (default) runs the step eagerly. ``True`` (= ``"default"``) or a ``torch.compile`` mode
            (``"reduce-overhead"`` for CUDA graphs, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``) compiles
            it. For SGD and Adam/AdamW the gradient, the optimizer update and the masking of finished clients are
            one compiled graph; other optimizers compile the gradient and keep ``torch.optim``'s step. Compiled
            graphs are cached per module and optimizer configuration, so later rounds reuse them. ``torch.func``
            graphs cannot have a dynamic cohort size, so a compiled cohort is padded to a bucket size (a multiple
            of 8 up to 64, then of 1/8 of the power of two below ``C``) with inactive rows: one compilation per
            bucket, not per size. If ``torch.compile`` fails for this model, the step runs uncompiled and one
            ``RuntimeWarning`` names the cause; so it does when one Python value the step reads keeps changing (a
            ``training_step`` that assigns ``self.counter``) and has forced ``RECOMPILE_GUARD_LIMIT`` (3)
            recompilations. Dropout draws differ from the uncompiled path (inductor has its own random-number
            generator).

    On a CPU the first cohort raises glibc's mmap and trim thresholds for the process (:mod:`._malloc`): the cohort's
    temporaries are ``C`` times larger than one client's, and glibc would otherwise map and fault in fresh pages for
    them at every step (up to 17 % of a CNN round). ``LIGHTNING_FEDHET_MALLOPT=0`` leaves the allocator alone.

    Buffers (BatchNorm's running statistics and ``num_batches_tracked``, any counter ``training_step`` keeps) are
    stacked per client like the parameters: each client's forward pass updates its own row, and a client whose
    local steps are used up keeps its row unchanged.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        clients: Sequence[int],
        local_steps: np.ndarray,
        *,
        starts: Tensor | None = None,
        int_starts: Tensor | None = None,
        compile: bool | str = False,
        layout: StateLayout | None = None,
    ) -> None:
        check_vmap_support(module, optimizer)
        self.mode = _compile_mode(compile)
        self.module = module
        self.clients = list(clients)
        self.local_steps = torch.as_tensor(np.asarray(local_steps), dtype=torch.int64)
        layout = self.layout = layout if layout is not None else StateLayout(module)
        named = layout.params
        self.names = [name for name, _ in named]
        size = len(self.clients)
        if starts is None or int_starts is None:
            own, own_ints = layout.current()
            starts = own.unsqueeze(0).expand(size, -1) if starts is None else starts
            int_starts = own_ints.unsqueeze(0).expand(size, -1) if int_starts is None else int_starts
        if starts.shape != (size, layout.num_parameters + sum(b.numel() for _, b in layout.float_buffers)):
            raise ValueError(f"starts must have shape [{size}, d] for {size} clients, got {tuple(starts.shape)}")
        # stacked rows: the cohort, padded to a bucket size when compiled (see ``compile``)
        self._rows = padded_size(size) if self.mode is not None else size
        self.trainable = {name: p.requires_grad for name, p in named}
        params = StateLayout.split(starts[:, : layout.num_parameters], named)
        self.params = {name: p.requires_grad_(self.trainable[name]) for name, p in params.items()}
        self.buffers = StateLayout.split(starts[:, layout.num_parameters :], layout.float_buffers)
        self.buffers.update(StateLayout.split(int_starts, layout.int_buffers))
        self.buffers = {name: self.buffers[name] for name, _ in module.named_buffers()}
        first = next(iter(self.params.values()))
        device, dtype = first.device, first.dtype
        if device.type == "cpu":
            keep_freed_memory()  # no page faults for the cohort's large temporaries at every step (see _malloc.py)
        by_id = {id(p): name for name, p in named}
        self._source_optimizer, self._by_id = optimizer, by_id
        self.optimizer: torch.optim.Optimizer | None = None
        max_steps = int(self.local_steps.max()) if size else 0
        # [K, rows]: which clients take local step k (a finished client's rows, and padding rows, must not move)
        steps = torch.cat([self.local_steps, self.local_steps.new_zeros(self._rows - size)])
        self._active = (steps.unsqueeze(0) > torch.arange(max_steps).unsqueeze(1)).to(device)
        self._loss_sum = torch.zeros(self._rows, dtype=torch.float32, device=device)
        self._steps_taken = 0
        self._fused: CompiledEntry | None = None
        self._grad_entry: CompiledEntry | None = None
        self.buffers = {name: _pad_rows(b, self._rows) for name, b in self.buffers.items()}
        rules = update_rules(optimizer, by_id) if self.mode is not None else None
        if self.mode is not None and rules is not None:
            self._fused = compiled_entry(module, rules, self.mode)
            self._rules = rules
            self._scalars = step_scalars(optimizer, rules, max(max_steps, 1)).to(device=device, dtype=dtype)
            self._state = {
                name: tuple(torch.zeros_like(p) for _ in range(rules[name].num_state)) if name in rules else ()
                for name, p in self.params.items()
            }
            self.params = {name: _pad_rows(p.detach(), self._rows) for name, p in self.params.items()}
            self._state = {name: tuple(_pad_rows(t, self._rows) for t in ts) for name, ts in self._state.items()}
            if self._fused.failed is not None:
                self._leave_fused()
        elif self.mode is not None:
            self._grad_entry = compiled_entry(module, None, self.mode)
        #: the compiled steps this cohort uses (``None`` uncompiled); ``compiled_entry.failed`` says why it stopped
        self.compiled_entry = self._fused if self._fused is not None else self._grad_entry
        if self._fused is None:
            self.optimizer = self._stacked_optimizer()
        self._collector = LogCollector()
        self._eager_grad = make_grad_step(make_loss(StepModule(module), self._collector))

    @property
    def compiled(self) -> bool:
        """Whether the next step runs compiled."""
        entry = self.compiled_entry
        return entry is not None and entry.failed is None

    def _stacked_optimizer(self) -> torch.optim.Optimizer:
        groups = []
        for group in self._source_optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": [self.params[self._by_id[id(p)]] for p in group["params"]], **hyper})
        return type(self._source_optimizer)(groups)

    def step(self, batch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Run local step ``step`` for every client whose ``local_steps > step``.

        Args:
            batch: the clients' mini-batches stacked on a leading client dimension ``[C, B, ...]``.
            step: 0-based local step index.

        Returns:
            per-client losses ``[C]`` and the per-client values ``[C]`` of every ``self.log`` call.
        """
        if step < self._active.shape[0]:
            active = self._active[step]
        else:
            active = torch.zeros_like(self._loss_sum, dtype=torch.bool)
        if self._fused is not None:
            graphs = self.mode in _CUDA_GRAPH_MODES and self._loss_sum.is_cuda
            try:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with _logging_to(self.module, self._fused.collector), _recompile_budget():
                    out = self._fused.fn(
                        self.params,
                        self.buffers,
                        self._state,
                        _pad_batch(batch, self._rows),
                        step,
                        active,
                        self._scalars[min(step, self._scalars.shape[0] - 1)],
                        self._loss_sum,
                    )
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the eager step
                _warn_compile_failed(self._fused, err)
                self._leave_fused()
            else:
                if graphs:
                    # the next replay overwrites a CUDA graph's outputs: keep copies (O(C d), cheap on a GPU)
                    out = _clone_tree(out)
                self.params, self._state, self.buffers, self._loss_sum, losses, logged = out
                self._steps_taken = step + 1
                size = len(self.clients)
                if _gave_up_recompiling(self._fused):  # this step's result stands; the next ones run eagerly
                    self._leave_fused()
                return losses[:size], {k: v[:size] for k, v in logged.items()}
        return self._eager_step(batch, step, active)

    def _eager_step(self, batch, step: int, active: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``active`` covers every stacked row (padding rows included while a compiled gradient is in use)."""
        size, rows = len(self.clients), self._rows
        frozen = (~active[:size]).nonzero().flatten()
        saved = self._snapshot(frozen) if frozen.numel() else None
        grads = losses = values = None
        if self._grad_entry is not None and self._grad_entry.failed is None:
            graphs = self.mode in _CUDA_GRAPH_MODES and self._loss_sum.is_cuda
            try:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                padded = {k: _pad_rows(v, rows) for k, v in self._detached().items()}
                with _logging_to(self.module, self._grad_entry.collector), _recompile_budget():
                    out = self._grad_entry.fn(padded, self.buffers, _pad_batch(batch, rows), step, active)
                _gave_up_recompiling(self._grad_entry)  # later steps take the eager gradient
                if graphs:
                    out = _clone_tree(out)
                grads, (losses, values), buffers = out
                grads, (losses, values) = _slice_tree((grads, (losses, values)), size)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the eager gradient
                _warn_compile_failed(self._grad_entry, err)
                grads = None
        if grads is None:
            self._unpad()
            try:
                with _logging_to(self.module, self._collector):
                    grads, (losses, values), buffers = self._eager_grad(
                        self._detached(), self.buffers, batch, step, active[:size]
                    )
            except VmapUnsupported:
                raise
            except RuntimeError as err:
                raise VmapUnsupported(f"torch.func could not transform training_step ({err})") from err
        self.buffers = buffers
        for name, p in self.params.items():
            p.grad = grads[name] if p.requires_grad else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if saved is not None:
            self._restore(frozen, saved)
        losses = losses.detach()
        self._loss_sum[:size] += torch.where(active[:size], losses.to(self._loss_sum.dtype), 0)
        self._steps_taken = step + 1
        return losses, {name: value.detach() for name, value in values.items()}

    def _unpad(self) -> None:
        """Drop padding rows for good (the eager gradient runs on the cohort's own rows)."""
        size = len(self.clients)
        if self._rows != size:
            self._rows = size
            self.buffers = {name: b[:size].clone() for name, b in self.buffers.items()}
            self._active, self._loss_sum = self._active[:, :size], self._loss_sum[:size].clone()

    def _detached(self) -> dict[str, Tensor]:
        return {k: v.detach() for k, v in self.params.items()}

    def _leave_fused(self) -> None:
        """Continue on the eager path: ``torch.optim`` takes over the fused step's parameters and state."""
        size = len(self.clients)
        self._unpad()
        self._state = {name: tuple(t[:size].clone() for t in ts) for name, ts in self._state.items()}
        self.params = {
            name: p.detach()[:size].clone().requires_grad_(self.trainable[name]) for name, p in self.params.items()
        }
        self.optimizer = self._stacked_optimizer()
        if self._steps_taken:
            for name, p in self.params.items():
                state = self._state[name]
                if not state:
                    continue
                if self._rules[name].kind == "sgd":
                    self.optimizer.state[p] = {"momentum_buffer": state[0]}
                else:
                    step = torch.tensor(float(self._steps_taken))
                    self.optimizer.state[p] = {"step": step, "exp_avg": state[0], "exp_avg_sq": state[1]}
        self._fused = None

    @property
    def log_display(self) -> dict[str, dict[str, Any]]:
        """Per logged name, the ``prog_bar`` / ``logger`` / ``reduce_fx`` arguments ``training_step`` passed to
        ``self.log``."""
        display: dict[str, dict[str, Any]] = {}
        for entry in (self._fused, self._grad_entry):
            if entry is not None:
                display.update(entry.collector.display)
        display.update(self._collector.display)
        return display

    def mean_losses(self) -> Tensor:
        """Each client's mean training loss over the local steps it took, ``[C]`` (NaN for a client with none)."""
        taken = torch.clamp(self.local_steps.to(self._loss_sum.device), max=self._steps_taken)
        loss_sum = self._loss_sum[: len(self.clients)]
        return torch.where(taken > 0, loss_sum / taken.clamp(min=1), torch.nan)

    def _snapshot(self, rows: Tensor) -> dict[str, Tensor]:
        """The finished clients' parameters, put back after the stacked optimizer step moved every row. Their
        optimizer state moves too and is left so: a client never takes a step after its last one, and a cohort lives
        one round (the vmap engine keeps no optimizer state across rounds), so nothing reads it again."""
        return {name: p.detach()[rows].clone() for name, p in self.params.items()}

    def _restore(self, rows: Tensor, saved: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, value in saved.items():
                self.params[name][rows] = value

    def flat_params(self) -> Tensor:
        """Each client's parameters flattened in ``named_parameters`` order: ``[C, num_parameters]``."""
        size = len(self.clients)
        return torch.cat([self.params[n].detach()[:size].reshape(size, -1) for n in self.names], dim=1)

    def flat_state(self) -> Tensor:
        """Each client's parameters then floating buffers, in :class:`StateLayout` order: ``[C, d]``."""
        size = len(self.clients)
        buffers = [
            self.buffers[n][:size].reshape(size, -1).to(self.params[self.names[0]].dtype)
            for n, _ in self.layout.float_buffers
        ]
        return torch.cat([self.flat_params(), *buffers], dim=1) if buffers else self.flat_params()

    def int_state(self) -> Tensor:
        """Each client's integer buffers as int64 ``[C, m]`` (``m = 0`` when the module has none)."""
        size = len(self.clients)
        ints = [self.buffers[n][:size].reshape(size, -1).to(torch.int64) for n, _ in self.layout.int_buffers]
        if not ints:
            return torch.zeros(size, 0, dtype=torch.int64, device=self._loss_sum.device)
        return torch.cat(ints, dim=1)


_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def padded_size(size: int) -> int:
    """The bucket a compiled cohort of ``size`` clients is padded to (at most 7 rows, or 12.5 %, of padding)."""
    step = max(8, 2 ** (max(size, 1).bit_length() - 4))
    return -(-size // step) * step


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """``t`` with its leading dimension padded to ``rows`` by repeating row 0 (padding rows are never active)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])


def _pad_batch(batch, rows: int):
    if isinstance(batch, Tensor):
        return _pad_rows(batch, rows)
    if isinstance(batch, dict):
        return {k: _pad_batch(v, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pad_batch(v, rows) for v in batch)
    return batch


def _slice_tree(tree, size: int):
    if isinstance(tree, Tensor):
        return tree[:size]
    if isinstance(tree, dict):
        return {k: _slice_tree(v, size) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_slice_tree(v, size) for v in tree)
    return tree


def _clone_tree(tree):
    if isinstance(tree, Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tree(v) for v in tree)
    return tree


_RECOMPILE_LIMIT = "recompile_limit" if "recompile_limit" in dir(torch._dynamo.config) else "cache_size_limit"


@contextmanager
def _recompile_budget():
    """Room for one compilation per cohort-size bucket (and per optimizer configuration) of a long run.

    Dynamo stops compiling a function after ``recompile_limit`` variants and then runs it eagerly; the compiled
    step legitimately has one variant per bucket, so the limit is raised for its calls only.
    """
    config = torch._dynamo.config
    name = _RECOMPILE_LIMIT
    previous = getattr(config, name)
    if previous >= 64:
        yield
        return
    # set and restore directly: ``config.patch`` costs ~25 us, paid at every local step of every round
    setattr(config, name, 64)
    try:
        yield
    finally:
        setattr(config, name, previous)


def _compile_mode(compile: bool | str) -> str | None:
    if compile is False:
        return None
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    raise ValueError(f"compile must be False, True or one of {COMPILE_MODES}, got {compile!r}")


@contextmanager
def _logging_to(module: nn.Module, collector: LogCollector):
    """Route ``module.log`` to ``collector`` for the duration of a vmapped step."""
    original = module.log
    module.log = collector
    try:
        yield
    finally:
        module.log = original


def _gave_up_recompiling(entry: CompiledEntry) -> bool:
    """Whether ``entry``'s last call showed it recompiling for every new value of a Python attribute; if so, mark it
    failed (no later round compiles it again) and warn once, naming the cause."""
    cause = entry.recompile_cause()
    if cause is None or entry.failed is not None:
        return False
    entry.failed = cause
    warnings.warn(
        f"torch.compile kept recompiling the vmap cohort step: {cause}. Running it uncompiled from here",
        RuntimeWarning,
        stacklevel=4,
    )
    return True


def _warn_compile_failed(entry: CompiledEntry, err: Exception) -> None:
    """Record the failure on the cached entry (so no later round retries) and warn once."""
    if entry.failed is not None:
        return
    cause = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:400]
    entry.failed = cause
    warnings.warn(
        f"torch.compile could not compile the vmap cohort step ({cause}); running it uncompiled",
        RuntimeWarning,
        stacklevel=3,
    )


class CohortRound(EngineBatch):
    """The vmap engine's one Lightning batch per round: ``len()`` lock-steps, built one at a time.

    ``lock_step(k)`` is local step ``k`` of every cohort: a list with one batch per cohort, each stacked on a
    leading client dimension ``[C, B, ...]`` and already moved to the device (through the module's transfer hooks,
    which therefore see the user's batch structure with that extra leading dimension). Only one step's data is
    materialised at a time, so a round holds O(C·B) samples, not O(K·C·B).
    """

    def __init__(self, lock_step: Callable[[int], list], num_steps: int) -> None:
        self.lock_step = lock_step
        self.num_steps = int(num_steps)

    def __len__(self) -> int:
        return self.num_steps

    def __repr__(self) -> str:
        return f"CohortRound(num_steps={self.num_steps})"


@dataclass
class CohortGroup:
    """One lock-step cohort of a round and whose rows it trains.

    A round of one federation, or of several stacked ones (many seeds), is split into groups by mini-batch size and
    by the rule's per-client config (Fed-CIS's exit); each group is one :class:`VmapCohort`. Row ``r`` is client
    ``cohort.clients[r]`` of federation ``owners[r]`` (rows are sorted by federation).
    """

    cohort: VmapCohort
    config: dict
    owners: np.ndarray


def build_groups(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    members: Sequence[tuple[Server, RoundPlan]],
    apply_config: Callable[[dict], None],
    compile: bool | str,
    layout: StateLayout,
) -> list[CohortGroup]:
    """The cohorts of an open round of every federation in ``members`` (``(server, plan)`` pairs), each client
    started from its own federation's global state through :meth:`Server.start_client`."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    configs: dict[tuple, dict] = {}
    for owner, (server, plan) in enumerate(members):
        sizes, batch = server.streams.sizes, server.streams.batch_size
        for client in plan.trained_ids:
            config = server.start_client(client).config
            key = (min(batch, int(sizes[client])), tuple(sorted(config.items())))
            groups.setdefault(key, []).append((owner, client))
            configs[key] = config
    out = []
    for key in sorted(groups):
        rows = groups[key]
        owners = np.array([owner for owner, _ in rows], dtype=np.int64)
        clients = [client for _, client in rows]
        steps = np.array([members[owner][1].local_steps[client] for owner, client in rows], dtype=np.int64)
        starts, int_starts = _start_rows(members, owners)
        apply_config(configs[key])
        cohort = VmapCohort(
            module, optimizer, clients, steps, starts=starts, int_starts=int_starts, compile=compile, layout=layout
        )
        out.append(CohortGroup(cohort, configs[key], owners))
    return out


def _start_rows(members: Sequence[tuple[Server, RoundPlan]], owners: np.ndarray) -> tuple[Tensor, Tensor]:
    """Each row's global vector ``[C, d]`` and integer buffers ``[C, m]`` (views, no copy, for one federation)."""
    blocks = [(owner, int(count)) for owner, count in zip(*np.unique(owners, return_counts=True))]
    floats = [members[owner][0].global_vector.unsqueeze(0).expand(count, -1) for owner, count in blocks]
    ints = [members[owner][0].global_ints.unsqueeze(0).expand(count, -1) for owner, count in blocks]
    if len(blocks) == 1:
        return floats[0], ints[0]
    return torch.cat(floats), torch.cat(ints)


def lock_step_batches(
    members: Sequence[tuple[Server, RoundPlan]], groups: Sequence[CohortGroup], to_device: Callable[[Any], Any]
) -> Callable[[int], list]:
    """``lock_step(k)``: local step ``k``'s batch of every group, stacked ``[C, B, ...]`` and moved to the device.

    A client that has finished repeats its last batch; its cohort leaves its rows unchanged.
    """
    by_client: list[dict[int, list[np.ndarray]]] = []
    for _, plan in members:
        own: dict[int, list[np.ndarray]] = {}
        for (client, _), idx in zip(plan.schedule, plan.batches):
            own.setdefault(client, []).append(idx)
        by_client.append(own)
    streams = [server.streams for server, _ in members]
    # one gather for every federation when they draw from the same dataset the same way (seeds of one configuration)
    shared = all(s.dataset is streams[0].dataset and s.collate_fn is streams[0].collate_fn for s in streams)

    def rows(group: CohortGroup, k: int) -> list[np.ndarray]:
        return [by_client[o][c][min(k, len(by_client[o][c]) - 1)] for o, c in zip(group.owners, group.cohort.clients)]

    def lock_step(k: int) -> list:
        out = []
        for group in groups:
            indices = np.stack(rows(group, k))
            if shared:
                batch = streams[0].stacked_batch(indices)
            else:
                owners = group.owners
                batch = cat_batches([streams[o].stacked_batch(indices[owners == o]) for o in np.unique(owners)])
            # each cohort's batch on its own: the module's transfer hooks see its own structure (stacked [C, B, ...])
            out.append(to_device(batch))
        return out

    return lock_step


def cat_batches(batches: Sequence) -> object:
    """Concatenate stacked batches (tensors, or lists/tuples/dicts of tensors) along the client dimension."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, Tensor):
        return torch.cat(list(batches))
    if isinstance(first, dict):
        return {k: cat_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(cat_batches([b[i] for b in batches]) for i in range(len(first)))
    raise TypeError(f"batches of type {type(first).__name__} cannot be concatenated per client")


def submit_groups(members: Sequence[tuple[Server, RoundPlan]], groups: Sequence[CohortGroup]) -> None:
    """Hand every trained row's update (parameters, floating buffers, integer buffers) to its federation's server:
    one :meth:`Server.submit_cohort` per group and federation (one finiteness check and one host sync each)."""
    for group in groups:
        cohort = group.cohort
        states, ints = cohort.flat_state(), cohort.int_state()
        losses = cohort.mean_losses().tolist()
        for owner in np.unique(group.owners):
            server = members[owner][0]
            rows = np.flatnonzero(group.owners == owner)
            take = slice(int(rows[0]), int(rows[-1]) + 1)  # rows are sorted by federation: one contiguous block
            vector = server.global_vector
            deltas = states[take].to(vector) - vector
            int_deltas = ints[take].to(server.global_ints) - server.global_ints if ints.shape[1] else None
            server.submit_cohort(
                [cohort.clients[r] for r in rows], deltas, [losses[r] for r in rows], int_deltas=int_deltas
            )


def run_lock_steps(
    groups: Sequence[CohortGroup],
    batch: CohortRound,
    first_step: int,
    apply_config: Callable[[dict], None],
) -> tuple[dict[str, list[tuple[Tensor, np.ndarray]]], dict[str, dict[str, Any]]]:
    """Every local step of a round's groups. Returns what ``self.log`` recorded: for each name, one
    ``(values, owners)`` pair per group and step, the values of the rows that took the step and their federations;
    and each logged name's ``prog_bar`` / ``logger`` / ``reduce_fx``, collected after every step (a cohort keeps only
    its last step's, and a name may be logged at some steps only)."""
    logs: dict[str, list[tuple[Tensor, np.ndarray]]] = {}
    display: dict[str, dict[str, Any]] = {}
    for k in range(len(batch)):
        step = first_step + k
        for group, group_batch in zip(groups, batch.lock_step(k)):
            apply_config(group.config)
            _, logged = group.cohort.step(group_batch, step)
            display.update(group.cohort.log_display)
            active = group.cohort.local_steps > step
            for name, values in logged.items():
                logs.setdefault(name, []).append((values[active.to(values.device)], group.owners[active.numpy()]))
    return logs, display


class VmapEngine(Engine):
    """The round's cohort in lock-step (see the module docstring).

    Clients are grouped by mini-batch size and by the rule's per-client config (Fed-CIS's exit): one
    :class:`VmapCohort` per group, each stepped with the module configured for its group. A config is supported
    exactly only without weight decay: torch.func gives a dense zero gradient to a parameter the client does not
    train, and weight decay would move it, where the sequential engine (gradient ``None``) leaves it untouched.
    """

    name = "vmap"
    keeps_client_optimizer_state = False
    supports_compile = True
    one_step_per_round = True

    def __init__(self, compile: bool | str = False) -> None:
        _compile_mode(compile)  # validate now, before any work
        super().__init__(compile)
        self.groups: list[CohortGroup] = []
        self._max_steps = 0
        self._layout: StateLayout | None = None

    @property
    def cohorts(self) -> list[VmapCohort]:
        """The open round's cohorts."""
        return [group.cohort for group in self.groups]

    def setup(self, module, optimizers, server, flat, to_device) -> None:
        check_vmap_setup(module, optimizers, server)
        # The cohort steps its own stacked copies and returns None to Lightning on purpose.
        warnings.filterwarnings("ignore", message=r"`training_step` returned `None`.*")
        super().setup(module, optimizers, server, flat, to_device)
        self._layout = StateLayout(module)

    def check_lr_schedulers(self, intervals: list[str]) -> None:
        if "step" in intervals:
            # The cohort reads the learning rate when the round starts, and Lightning steps a "step" scheduler once per
            # round here against once per local step of every client under the sequential engine.
            raise VmapUnsupported(
                "a learning-rate scheduler with interval='step' would advance once per round (one Lightning step) "
                "instead of once per local step; use interval='epoch' (once per round)"
            )

    def _members(self) -> list[tuple[Server, RoundPlan]]:
        return [(self.server, self.plan)]

    def _begin(self, plan: RoundPlan) -> None:
        self.flat.set(self.server.global_vector)
        self.groups = build_groups(
            self.module, self.optimizers[0], self._members(), self.apply_config, self.compile, self._layout
        )
        self._max_steps = int(plan.local_steps.max()) if plan.trained_ids else 0

    def _round_batches(self, plan: RoundPlan) -> Iterator:
        lock_step = lock_step_batches(self._members(), list(self.groups), self.to_device)
        return iter([CohortRound(lock_step, self._max_steps)])

    def on_batch_start(self) -> None:
        return None

    def training_step(self, default_step, batch: CohortRound, batch_idx: int) -> None:
        logs, display = run_lock_steps(self.groups, batch, self.step, self.apply_config)
        self.step += len(batch)
        for name, chunks in logs.items():  # every client's steps reduced as the step asked, shown where it asked
            values = torch.cat([values for values, _ in chunks])
            if not values.numel():
                continue
            options = dict(display.get(name, {}))
            reduction = log_reduction(name, options.pop("reduce_fx", "mean"))
            # batch_size: a many-process run weights each process's mean by its count of client steps
            self.module.log(name, reduce_logged(values, reduction), on_step=False, on_epoch=True, reduce_fx=reduction,
                            batch_size=values.numel(), **options)
        # The cohort stepped its own stacked copies; Lightning's optimizer has nothing to do.
        return None

    def on_batch_end(self, output: Any) -> None:
        submit_groups(self._members(), self.groups)
        self.groups = []
        self.close_round()


def check_vmap_setup(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], server: Server) -> None:
    """Refuse, before any work, a fit the vmap engine cannot simulate (each error names the cause)."""
    if server.optimizer_state == "persist":
        raise VmapUnsupported("optimizer_state='persist' keeps one optimizer state per client")
    if len(optimizers) != 1:
        raise VmapUnsupported(f"the module has {len(optimizers)} optimizers; the engine steps exactly one")
    check_vmap_support(module, optimizers[0])
    decay = [group.get("weight_decay", 0) for group in optimizers[0].param_groups]
    if server.algorithm.sends_client_config and any(decay):
        raise VmapUnsupported(
            f"{type(server.algorithm).__name__} trains a different part of the model on each client and the "
            f"optimizer has weight_decay={decay}, which would move the parts a client does not train"
        )
