"""One round's cohort trained in lock-step with ``torch.func``: the clients' stacked state and its local steps.

Each client's parameters are one row of stacked tensors ``[C, *shape]`` (:mod:`.layout`). One local step of the cohort
is a single ``vmap(grad_and_value(training_step))`` call over the stacked parameters and the stacked client batches
``[C, B, ...]``, followed by one step of the user's optimizer class on the stacked tensors. Because the supported
optimizers (SGD, Adam, AdamW, RMSprop, Adagrad) update every element independently, stepping the stacked tensors is
the same as stepping each client's copy with its own state; their one scalar per tensor (Adam's step count) is
shared, which is exact because every client still training has taken the same number of steps. Clients with fewer
local steps than the round's maximum are masked so that they stay at their last real step: uncompiled, their rows
(parameters and optimizer state) are put back after each step; compiled (``compile=True``, see ``_compiled.py``), the
update is ``torch.where(active, new, old)`` inside the graph, which is exact and needs no copies. Multiplying the
gradients of finished clients by zero would not be exact: weight decay and momentum still move the parameters, and
Adam's moments still decay.

Buffers are stacked per client too: BatchNorm's running statistics and ``num_batches_tracked`` (and any counter a
``training_step`` keeps) enter ``functional_call`` as each client's own row, the updated rows come back as outputs of
the vmapped step (``torch.where(active, new, old)`` keeps a finished client's rows), and each client's change goes
to the server with its parameters: floating buffers are averaged there with sample weights and integer buffers move
by the rounded mean change, exactly as under the sequential engine.

Each cohort sums its clients' training losses as a tensor (:meth:`VmapCohort.mean_losses`), so an engine can read
them once per round instead of converting a value per client per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_fedhet.engines._compile_policy import (
    CUDA_GRAPH_MODES,
    compile_mode,
    gave_up_recompiling,
    logging_to,
    recompile_budget,
    warn_compile_failed,
)
from lightning_fedhet.engines._compiled import (
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
from lightning_fedhet.engines.cohort_checks import (  # noqa: F401  (ELEMENTWISE_OPTIMIZERS, check_vmap_support: re-exported)
    ELEMENTWISE_OPTIMIZERS,
    check_persistable,
    check_vmap_support,
    momentum_positions,
)
from lightning_fedhet.engines.layout import (
    StateLayout,
    clone_tree,
    pad_batch,
    pad_rows,
    padded_size,
    slice_tree,
)


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
        optimizer_states: Sequence[list[dict] | None] | None = None,
    ) -> None:
        layout = self.layout = layout if layout is not None else StateLayout(module)
        check_vmap_support(module, optimizer, layout)
        self.mode = compile_mode(compile)
        self.module = module
        self.clients = list(clients)
        self.local_steps = torch.as_tensor(np.asarray(local_steps), dtype=torch.int64)
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
        self.buffers = {name: self.buffers[name] for name in layout.buffer_names}
        first = next(iter(self.params.values()))
        device, dtype = first.device, first.dtype
        if device.type == "cpu":
            keep_freed_memory()  # no page faults for the cohort's large temporaries at every step (see _malloc.py)
        by_id = {id(p): name for name, p in named}
        self._source_optimizer, self._by_id = optimizer, by_id
        self.optimizer: torch.optim.Optimizer | None = None
        #: whether the clients' optimizer states come in and go back (``optimizer_state="persist"``)
        self.persist = optimizer_states is not None
        #: ``(position, name)`` of each parameter whose momentum buffer comes in and goes back (persist only)
        self._momentum: list[tuple[int, str]] = []
        kept: dict[str, Tensor] = {}
        if self.persist:
            check_persistable(optimizer)
            if len(optimizer_states) != size:
                raise ValueError(
                    f"optimizer_states must hold one entry per client ({size}), got {len(optimizer_states)}"
                )
            self._momentum = momentum_positions(optimizer, by_id)
            kept = {name: self._kept_buffers(optimizer_states, position, self.params[name])
                    for position, name in self._momentum}
        max_steps = int(self.local_steps.max()) if size else 0
        # [K, rows]: which clients take local step k (a finished client's rows, and padding rows, must not move)
        steps = torch.cat([self.local_steps, self.local_steps.new_zeros(self._rows - size)])
        self._active = (steps.unsqueeze(0) > torch.arange(max_steps).unsqueeze(1)).to(device)
        self._loss_sum = torch.zeros(self._rows, dtype=torch.float32, device=device)
        self._steps_taken = 0
        self._fused: CompiledEntry | None = None
        self._grad_entry: CompiledEntry | None = None
        self.buffers = {name: pad_rows(b, self._rows) for name, b in self.buffers.items()}
        rules = update_rules(optimizer, by_id) if self.mode is not None else None
        if self.mode is not None and rules is not None:
            self._fused = compiled_entry(module, rules, self.mode)
            self._rules = rules
            self._scalars = step_scalars(optimizer, rules, max(max_steps, 1)).to(device=device, dtype=dtype)
            self._state = {
                name: tuple(torch.zeros_like(p) for _ in range(rules[name].num_state)) if name in rules else ()
                for name, p in self.params.items()
            }
            self._state.update({name: (buffer,) for name, buffer in kept.items()})
            self.params = {name: pad_rows(p.detach(), self._rows) for name, p in self.params.items()}
            self._state = {name: tuple(pad_rows(t, self._rows) for t in ts) for name, ts in self._state.items()}
            if self._fused.failed is not None:
                self._leave_fused()
        elif self.mode is not None:
            self._grad_entry = compiled_entry(module, None, self.mode)
        #: the compiled steps this cohort uses (``None`` uncompiled); ``compiled_entry.failed`` says why it stopped
        self.compiled_entry = self._fused if self._fused is not None else self._grad_entry
        if self._fused is None:
            self.optimizer = self._stacked_optimizer()
            for name, buffer in kept.items():
                self.optimizer.state[self.params[name]] = {"momentum_buffer": buffer}
        self._collector = LogCollector()
        self._eager_grad_fn: Callable | None = None  # built on first use: a compiled cohort may never need it

    @property
    def rows(self) -> int:
        """The stacked rows: the cohort's clients, then the padding rows of a compiled cohort's bucket. :meth:`step`
        takes a batch of ``len(clients)`` rows or of ``rows`` (padding rows repeating row 0, as :func:`pad_rows`)."""
        return self._rows

    @property
    def compiled(self) -> bool:
        """Whether the next step runs compiled."""
        entry = self.compiled_entry
        return entry is not None and entry.failed is None

    @staticmethod
    def _kept_buffers(states: Sequence[list[dict] | None], position: int, param: Tensor) -> Tensor:
        """One parameter's momentum buffers stacked over the clients ``[C, *shape]``, zeros for a client without one."""
        stacked = torch.zeros_like(param).detach()
        for row, state in enumerate(states):
            own = state[0].get(position) if state else None
            if own and own.get("momentum_buffer") is not None:
                stacked[row] = own["momentum_buffer"]
        return stacked

    def client_optimizer_states(self) -> list[list[dict]]:
        """Each client's optimizer state after the round, in the server's format (see ``optimizer_states``): one
        ``[{position: {"momentum_buffer": tensor}}]`` per client (an empty dict where SGD has no momentum)."""
        if not self.persist:
            raise RuntimeError("the cohort was built without optimizer_states (optimizer_state='reset')")
        buffers = {name: self._momentum_buffer(name) for _, name in self._momentum}
        return [
            [{position: {"momentum_buffer": buffers[name][row].clone()} for position, name in self._momentum}]
            for row in range(len(self.clients))
        ]

    def _momentum_buffer(self, name: str) -> Tensor:
        """The stacked momentum buffer of parameter ``name`` now (the fused step's state or ``torch.optim``'s)."""
        if self._fused is not None:
            return self._state[name][0].detach()
        return self.optimizer.state[self.params[name]]["momentum_buffer"]

    def _stacked_optimizer(self) -> torch.optim.Optimizer:
        groups = []
        for group in self._source_optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": [self.params[self._by_id[id(p)]] for p in group["params"]], **hyper})
        return type(self._source_optimizer)(groups)

    def step(self, batch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Run local step ``step`` for every client whose ``local_steps > step``.

        Args:
            batch: the clients' mini-batches stacked on a leading client dimension ``[C, B, ...]``, or ``[rows, B,
                ...]`` with the padding rows of a compiled cohort (see :attr:`rows`).
            step: 0-based local step index.

        Returns:
            per-client losses ``[C]`` and the per-client values ``[C]`` of every ``self.log`` call.
        """
        if step < self._active.shape[0]:
            active = self._active[step]
        else:
            active = torch.zeros_like(self._loss_sum, dtype=torch.bool)
        if self._fused is not None:
            graphs = self.mode in CUDA_GRAPH_MODES and self._loss_sum.is_cuda
            try:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with logging_to(self.module, self._fused.collector), recompile_budget():
                    out = self._fused.fn(
                        self.params,
                        self.buffers,
                        self._state,
                        pad_batch(batch, self._rows),
                        step,
                        active,
                        self._scalars[min(step, self._scalars.shape[0] - 1)],
                        self._loss_sum,
                    )
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the eager step
                warn_compile_failed(self._fused, err)
                self._leave_fused()
            else:
                if graphs:
                    # the next replay overwrites a CUDA graph's outputs: keep copies (O(C d), cheap on a GPU)
                    out = clone_tree(out)
                self.params, self._state, self.buffers, self._loss_sum, losses, logged = out
                self._steps_taken = step + 1
                size = len(self.clients)
                if gave_up_recompiling(self._fused):  # this step's result stands; the next ones run eagerly
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
            graphs = self.mode in CUDA_GRAPH_MODES and self._loss_sum.is_cuda
            try:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                padded = {k: pad_rows(v, rows) for k, v in self._detached().items()}
                with logging_to(self.module, self._grad_entry.collector), recompile_budget():
                    out = self._grad_entry.fn(padded, self.buffers, pad_batch(batch, rows), step, active)
                gave_up_recompiling(self._grad_entry)  # later steps take the eager gradient
                if graphs:
                    out = clone_tree(out)
                grads, (losses, values), buffers = out
                grads, (losses, values) = slice_tree((grads, (losses, values)), size)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the eager gradient
                warn_compile_failed(self._grad_entry, err)
                grads = None
        if grads is None:
            self._unpad()
            if self.mode is not None:  # a batch gathered with the bucket's padding rows
                batch = slice_tree(batch, size)
            try:
                with logging_to(self.module, self._collector):
                    grads, (losses, values), buffers = self._eager_grad()(
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

    def _eager_grad(self) -> Callable:
        """The uncompiled vmapped gradient step (see :func:`make_grad_step`), built once per cohort when needed."""
        if self._eager_grad_fn is None:
            self._eager_grad_fn = make_grad_step(make_loss(StepModule(self.module), self._collector))
        return self._eager_grad_fn

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
        if self._steps_taken or self.persist:  # a kept momentum buffer is state before the first step too
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

    def _snapshot(self, rows: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The finished clients' parameters, put back after the stacked optimizer step moved every row, and with
        ``optimizer_state="persist"`` their momentum buffers, which go back to the server. Without it their optimizer
        state is left as the step moved it: a client never takes a step after its last one, and a fresh state is
        made for each round, so nothing reads it again."""
        params = {name: p.detach()[rows].clone() for name, p in self.params.items()}
        buffers = {name: self._momentum_buffer(name)[rows].clone() for _, name in self._momentum}
        return params, buffers

    def _restore(self, rows: Tensor, saved: tuple[dict[str, Tensor], dict[str, Tensor]]) -> None:
        params, buffers = saved
        with torch.no_grad():
            for name, value in params.items():
                self.params[name][rows] = value
            for name, value in buffers.items():
                self._momentum_buffer(name)[rows] = value

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
