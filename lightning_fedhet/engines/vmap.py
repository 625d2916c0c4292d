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

Each cohort sums its clients' training losses as a tensor (:meth:`VmapCohort.mean_losses`), so an engine can read
them once per round instead of converting a value per client per step.

Limits (each raises :class:`VmapUnsupported` naming the cause and the ``engine="sequential"`` fallback):
modules with running statistics (BatchNorm), optimizers whose state is not elementwise (LBFGS, ...),
per-client persistent optimizer state, data-dependent Python control flow in ``training_step`` (caught when
``torch.func`` refuses it), manual optimization, learning-rate schedulers with ``interval="step"`` (they would
advance once per round here; ``"epoch"`` schedulers advance once per round under both engines and give the same
run). ``self.log`` inside ``training_step`` works: each logged value is computed per client and the strategy logs
their mean.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
from lightning_fedhet.engines.base import Engine, EngineBatch
from lightning_fedhet.federation import RoundPlan

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
        if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
            raise VmapUnsupported(
                f"module '{name}' ({type(sub).__name__}) keeps running statistics, which vmap cannot update per client"
            )
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        raise VmapUnsupported(
            f"optimizer {type(optimizer).__name__} is not one whose state is elementwise "
            f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)})"
        )


class VmapCohort:
    """One round's cohort, trained in lock-step.

    Args:
        module: the user's LightningModule (its parameters hold the global model).
        optimizer: the user's optimizer (class, hyper-parameters and current learning rates are copied).
        clients: the cohort's client ids (length ``C``).
        local_steps: steps each client runs, int ``[C]``.
        compile: ``False`` (default) runs the step eagerly. ``True`` (= ``"default"``) or a ``torch.compile`` mode
            (``"reduce-overhead"`` for CUDA graphs, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``) compiles
            it. For SGD and Adam/AdamW the gradient, the optimizer update and the masking of finished clients are
            one compiled graph; other optimizers compile the gradient and keep ``torch.optim``'s step. Compiled
            graphs are cached per module and optimizer configuration, so later rounds reuse them. ``torch.func``
            graphs cannot have a dynamic cohort size, so a compiled cohort is padded to a bucket size (a multiple
            of 8 up to 64, then of 1/8 of the power of two below ``C``) with inactive rows: one compilation per
            bucket, not per size. If ``torch.compile`` fails for this model, the step runs uncompiled and one
            ``RuntimeWarning`` names the cause. Dropout draws differ from the uncompiled path (inductor has its
            own random-number generator).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        clients: Sequence[int],
        local_steps: np.ndarray,
        *,
        compile: bool | str = False,
    ) -> None:
        check_vmap_support(module, optimizer)
        self.mode = _compile_mode(compile)
        self.module = module
        self.clients = list(clients)
        self.local_steps = torch.as_tensor(np.asarray(local_steps), dtype=torch.int64)
        named = list(module.named_parameters())  # one walk of the module tree (it is rebuilt every round)
        self.names = [name for name, _ in named]
        size = len(self.clients)
        # stacked rows: the cohort, padded to a bucket size when compiled (see ``compile``)
        self._rows = padded_size(size) if self.mode is not None else size
        self.trainable = {name: p.requires_grad for name, p in named}
        self.params = {
            name: p.detach().unsqueeze(0).repeat(size, *([1] * p.dim())).requires_grad_(p.requires_grad)
            for name, p in named
        }
        self.buffers = {name: b for name, b in module.named_buffers()}
        first = next(iter(self.params.values()))
        device, dtype = first.device, first.dtype
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
        if self._fused is None:
            self.optimizer = self._stacked_optimizer()
        self._collector = LogCollector()
        self._eager_grad = make_grad_step(make_loss(StepModule(module), self._collector))

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
                self.params, self._state, self._loss_sum, losses, logged = out
                self._steps_taken = step + 1
                size = len(self.clients)
                return losses[:size], {k: v[:size] for k, v in logged.items()}
        return self._eager_step(batch, step, active[: len(self.clients)])

    def _eager_step(self, batch, step: int, active: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        frozen = (~active).nonzero().flatten()
        saved = self._snapshot(frozen) if frozen.numel() else None
        grads = losses = values = None
        if self._grad_entry is not None and self._grad_entry.failed is None:
            size, rows = len(self.clients), self._rows
            graphs = self.mode in _CUDA_GRAPH_MODES and self._loss_sum.is_cuda
            try:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                padded = {k: _pad_rows(v, rows) for k, v in self._detached().items()}
                with _logging_to(self.module, self._grad_entry.collector), _recompile_budget():
                    out = self._grad_entry.fn(padded, self.buffers, _pad_batch(batch, rows), step)
                if graphs:
                    out = _clone_tree(out)
                grads, (losses, values) = _slice_tree(out, size)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the eager gradient
                _warn_compile_failed(self._grad_entry, err)
                grads = None
        if grads is None:
            try:
                with _logging_to(self.module, self._collector):
                    grads, (losses, values) = self._eager_grad(self._detached(), self.buffers, batch, step)
            except VmapUnsupported:
                raise
            except RuntimeError as err:
                raise VmapUnsupported(f"torch.func could not transform training_step ({err})") from err
        for name, p in self.params.items():
            p.grad = grads[name] if p.requires_grad else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if saved is not None:
            self._restore(frozen, saved)
        losses = losses.detach()
        self._loss_sum[: len(self.clients)] += torch.where(active, losses.to(self._loss_sum.dtype), 0)
        self._steps_taken = step + 1
        return losses, {name: value.detach() for name, value in values.items()}

    def _detached(self) -> dict[str, Tensor]:
        return {k: v.detach() for k, v in self.params.items()}

    def _leave_fused(self) -> None:
        """Continue on the eager path: ``torch.optim`` takes over the fused step's parameters and state."""
        size = len(self.clients)
        self._rows = size
        self._active, self._loss_sum = self._active[:, :size], self._loss_sum[:size].clone()
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

    def mean_losses(self) -> Tensor:
        """Each client's mean training loss over the local steps it took, ``[C]`` (NaN for a client with none)."""
        taken = torch.clamp(self.local_steps.to(self._loss_sum.device), max=self._steps_taken)
        loss_sum = self._loss_sum[: len(self.clients)]
        return torch.where(taken > 0, loss_sum / taken.clamp(min=1), torch.nan)

    def _snapshot(self, rows: Tensor) -> dict:
        state = {name: p.detach()[rows].clone() for name, p in self.params.items()}
        opt_state = {}
        for name, p in self.params.items():
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == p.shape[0]:
                    opt_state[(name, key)] = value[rows].clone()
        return {"params": state, "opt": opt_state}

    def _restore(self, rows: Tensor, saved: dict) -> None:
        with torch.no_grad():
            for name, value in saved["params"].items():
                self.params[name][rows] = value
            for (name, key), value in saved["opt"].items():
                self.optimizer.state[self.params[name]][key][rows] = value

    def flat_params(self) -> Tensor:
        """Each client's parameters flattened in ``named_parameters`` order: ``[C, num_parameters]``."""
        size = len(self.clients)
        return torch.cat([self.params[n].detach()[:size].reshape(size, -1) for n in self.names], dim=1)


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
        self.cohorts: list[VmapCohort] = []
        self.configs: list[dict] = []
        self._max_steps = 0

    def setup(self, module, optimizers, server, flat, to_device) -> None:
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
        # The cohort steps its own stacked copies and returns None to Lightning on purpose.
        warnings.filterwarnings("ignore", message=r"`training_step` returned `None`.*")
        super().setup(module, optimizers, server, flat, to_device)

    def check_lr_schedulers(self, intervals: list[str]) -> None:
        if "step" in intervals:
            # The cohort reads the learning rate when the round starts, and Lightning steps a "step" scheduler once per
            # round here against once per local step of every client under the sequential engine.
            raise VmapUnsupported(
                "a learning-rate scheduler with interval='step' would advance once per round (one Lightning step) "
                "instead of once per local step; use interval='epoch' (once per round) or"
            )

    def _begin(self, plan: RoundPlan) -> None:
        server = self.server
        sizes, batch = server.streams.sizes, server.streams.batch_size
        groups: dict[tuple, list[int]] = {}
        configs: dict[tuple, dict] = {}
        for client in plan.trained_ids:
            config = server.start_client(client).config
            key = (min(batch, int(sizes[client])), tuple(sorted(config.items())))
            groups.setdefault(key, []).append(client)
            configs[key] = config
        keys = sorted(groups)
        self.flat.set(server.global_vector)
        self.cohorts, self.configs = [], []
        for key in keys:
            self.apply_config(configs[key])
            clients = groups[key]
            steps = plan.local_steps[clients]
            self.cohorts.append(VmapCohort(self.module, self.optimizers[0], clients, steps, compile=self.compile))
            self.configs.append(configs[key])
        self._max_steps = int(plan.local_steps.max()) if plan.trained_ids else 0

    def _round_batches(self, plan: RoundPlan) -> Iterator:
        by_client: dict[int, list[np.ndarray]] = {}
        for (client, _), idx in zip(plan.schedule, plan.batches):
            by_client.setdefault(client, []).append(idx)
        streams, cohorts, to_device = self.server.streams, list(self.cohorts), self.to_device

        def lock_step(k: int) -> list:
            # A client that has finished repeats its last batch; the cohort leaves its rows unchanged.
            rows = [[by_client[c][min(k, len(by_client[c]) - 1)] for c in cohort.clients] for cohort in cohorts]
            # each cohort's batch on its own: the module's transfer hooks see its own structure (stacked [C, B, ...])
            return [to_device(streams.stacked_batch(np.stack(indices))) for indices in rows]

        return iter([CohortRound(lock_step, self._max_steps)])

    def on_batch_start(self) -> None:
        return None

    def training_step(self, default_step, batch: CohortRound, batch_idx: int) -> None:
        logs: dict[str, list[Tensor]] = {}
        for k in range(len(batch)):
            for i, (cohort, group_batch) in enumerate(zip(self.cohorts, batch.lock_step(k))):
                self.apply_config(self.configs[i])
                _, logged = cohort.step(group_batch, self.step)
                active = cohort.local_steps > self.step
                for name, values in logged.items():
                    logs.setdefault(name, []).append(values[active])
            self.step += 1
        for name, chunks in logs.items():
            self.module.log(name, torch.cat(chunks).mean(), on_step=False, on_epoch=True, batch_size=1)
        # The cohort stepped its own stacked copies; Lightning's optimizer has nothing to do.
        return None

    def on_batch_end(self, output: Any) -> None:
        self._submit_all()
        self.close_round()

    def _submit_all(self) -> None:
        server = self.server
        vector = server.global_vector
        num_parameters = self.flat.num_parameters
        has_buffers = vector.numel() > num_parameters
        for cohort in self.cohorts:
            deltas = cohort.flat_params().to(vector) - vector[:num_parameters]
            if has_buffers:  # the cohort keeps the global buffers (no running statistics): their change is zero
                deltas = torch.cat([deltas, deltas.new_zeros(len(deltas), vector.numel() - num_parameters)], dim=1)
            # one host sync per cohort for the losses, one for the finiteness check: not one per client or step
            server.submit_cohort(cohort.clients, deltas, cohort.mean_losses().tolist())
        self.cohorts = []
