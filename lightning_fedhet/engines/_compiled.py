"""The compiled local step of the vmap engine: gradient, optimizer update and masking in one ``torch.compile`` graph.

One call runs local step ``k`` of a whole cohort: ``vmap(grad_and_value(training_step))`` over the stacked
parameters ``[C, *shape]``, then the optimizer's update written out as elementwise tensor algebra, then
``torch.where(active, new, old)`` so that clients whose local steps are used up keep their parameters and optimizer
state bit for bit. Written this way the whole step is one pure function of tensors, so inductor fuses the update
and the mask into a few kernels and no snapshot/restore copies are needed.

The update formulas transcribe PyTorch's single-tensor ``SGD`` and ``Adam``/``AdamW`` step (``torch/optim/sgd.py``,
``torch/optim/adam.py``) line by line:

* SGD: ``g = grad (+ wd * p)``; ``buf = momentum * buf + (1 - dampening) * g`` (``buf = g`` at the first step);
  ``g = g + momentum * buf`` (Nesterov) or ``g = buf``; ``p = p - lr * g``.
* Adam: ``g = grad (+ wd * p)`` (AdamW instead ``p = p * (1 - lr * wd)``); ``m = lerp(m, g, 1 - beta1)``;
  ``v = beta2 * v + (1 - beta2) * g * g``; ``p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.

Every client still training has taken the same number of steps ``t = k + 1`` (all start at step 0), so the
step-dependent scalars (learning rate, bias corrections, the first-step momentum factor) are shared across the cohort;
they enter the graph as one small tensor per step, so a learning-rate schedule does not trigger a recompilation.
Optimizers or options outside these two (RMSprop, Adagrad, ``amsgrad``) compile the gradient only and keep
``torch.optim``'s step.
"""

from __future__ import annotations

import itertools
import re
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._dynamo.utils import guard_failures
from torch.func import functional_call, grad_and_value, vmap

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# How many modules keep their compiled steps alive (each entry holds its module and compiled code).
_CACHE_MODULES = 4


class VmapUnsupported(RuntimeError):
    """The model, optimizer or configuration cannot run under ``engine="vmap"``."""

    def __init__(self, cause: str) -> None:
        super().__init__(f"engine='vmap' cannot run this: {cause}. Use engine='sequential' instead.")


class StepModule(nn.Module):
    """Makes ``lightning_module.training_step`` the ``forward`` that ``functional_call`` runs.

    ``forward`` returns ``(output, buffers)``: the module's buffers as ``training_step`` left them (BatchNorm's running
    statistics and ``num_batches_tracked``, a counter the step keeps), read inside ``functional_call`` so that both an
    in-place update and a reassignment (``self.counter = self.counter + 1``) are seen. Under ``vmap`` each is the
    client's own row.
    """

    def __init__(self, lightning_module: nn.Module) -> None:
        super().__init__()
        self.lm = lightning_module

    def forward(self, batch, batch_idx: int):
        out = self.lm.training_step(batch, batch_idx)
        return out, dict(self.lm.named_buffers())


#: ``LightningModule.log``'s arguments after ``name`` and ``value``, in its positional order
LOG_POSITIONAL = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx")
#: those the vmap engine follows when it logs a round's value: where it is shown, and how the values are reduced
LOG_DISPLAY = ("prog_bar", "logger", "reduce_fx")


class LogCollector:
    """Stands in for ``LightningModule.log`` during a vmapped step: records names and per-client values, and where
    each name is to be shown and how its values are reduced (:attr:`display`)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.values: list[Tensor] = []
        self._shown: list[dict[str, Any]] = []
        #: per name, the ``prog_bar`` / ``logger`` / ``reduce_fx`` arguments of the last step's ``self.log`` call: the
        #: engine logs the round's value with them, as the sequential engine logs every step's
        self.display: dict[str, dict[str, Any]] = {}

    def __call__(self, name: str, value, *args, **kwargs) -> None:
        self.names.append(name)
        self.values.append(torch.as_tensor(value, dtype=torch.float32))
        shown = {key: arg for key, arg in zip(LOG_POSITIONAL, args) if key in LOG_DISPLAY}
        shown.update({key: kwargs[key] for key in LOG_DISPLAY if key in kwargs})
        self._shown.append(shown)

    def take(self) -> dict[str, Tensor]:
        """The values logged since the last call, by name; empties the collector (no transformed tensor stays).

        Under ``torch.compile`` this runs inside the compiled step, whose Python side effects are replayed at every
        call: the collector's lists are therefore emptied here and :attr:`display` is replaced, never read, so the
        state a call starts from is always the same and no guard asks for a recompilation."""
        logged = dict(zip(self.names, self.values))
        if self.names:
            self.display = dict(zip(self.names, self._shown))
        self.names, self.values, self._shown = [], [], []
        return logged


def make_loss(step_module: StepModule, collector: LogCollector) -> Callable:
    """``loss(params, buffers, batch, batch_idx) -> (loss, (logged, buffers_after))`` for one client, as
    ``grad_and_value`` wants it. ``buffers_after`` holds the client's buffers after the step (same keys as
    ``buffers``); the step may update ``buffers``' tensors in place, so callers pass copies they can lose."""

    def loss(params: dict[str, Tensor], buffers: dict[str, Tensor], batch, batch_idx: int):
        collector.take()
        state = {f"lm.{k}": v for k, v in params.items()}
        state.update({f"lm.{k}": v for k, v in buffers.items()})
        out, after = functional_call(step_module, state, (batch, batch_idx))
        value = out["loss"] if isinstance(out, dict) else out
        if not isinstance(value, Tensor):
            raise VmapUnsupported("training_step must return the loss tensor (or a dict with 'loss')")
        return value, (collector.take(), {k: after[k] for k in buffers})

    return loss


def _copies(buffers: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fresh copies of the stacked buffers for a step to update in place (the originals stay for the masking)."""
    return {k: v.clone() for k, v in buffers.items()}


def _mask_buffers(active: Tensor, after: dict[str, Tensor], before: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each row's buffers after the step where the row is active, else as they were (exact, any dtype)."""
    return {k: torch.where(_rows(active, v), after[k].to(v.dtype), v) for k, v in before.items()}


@dataclass(frozen=True)
class UpdateRule:
    """The static part of one parameter's optimizer update (baked into the compiled graph).

    ``kind`` is ``"sgd"`` or ``"adam"``; ``slot`` indexes the per-step scalars of the parameter's param group.
    """

    kind: str
    slot: int
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    decoupled: bool = False

    @property
    def num_state(self) -> int:
        """Per-parameter state tensors: SGD's momentum buffer (if any), Adam's two moments."""
        if self.kind == "adam":
            return 2
        return 1 if self.momentum != 0 else 0


# Scalars per param group and local step (float32 row of the per-round table ``[K, groups * SCALARS]``):
# SGD:  (lr, dampening factor: 1 at the first step, 1 - dampening after)
# Adam: (lr / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr * wd)
SCALARS = 3


def update_rules(optimizer: torch.optim.Optimizer, names_by_id: dict[int, str]) -> dict[str, UpdateRule] | None:
    """The per-parameter update rules of ``optimizer``, or None when the fused path does not cover it."""
    rules: dict[str, UpdateRule] = {}
    kind = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}.get(type(optimizer))
    if kind is None:
        return None
    for slot, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad", False) or group.get("differentiable", False):
            return None
        if any(isinstance(group.get(key), Tensor) for key in ("momentum", "dampening", "weight_decay", "betas")):
            return None
        if kind == "sgd":
            rule = UpdateRule(
                "sgd",
                slot,
                weight_decay=float(group["weight_decay"]),
                momentum=float(group["momentum"]),
                nesterov=bool(group["nesterov"]),
                maximize=bool(group.get("maximize", False)),
            )
        else:
            beta1, beta2 = group["betas"]
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
            rule = UpdateRule(
                "adam",
                slot,
                weight_decay=float(group["weight_decay"]),
                maximize=bool(group.get("maximize", False)),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                decoupled=decoupled,
            )
        for p in group["params"]:
            if p.requires_grad:
                rules[names_by_id[id(p)]] = rule
    return rules


def step_scalars(optimizer: torch.optim.Optimizer, rules: dict[str, UpdateRule], steps: int) -> Tensor:
    """The per-step scalars ``[steps, groups * SCALARS]`` (float64; cast to the parameters' dtype by the caller).

    Computed in Python floats exactly as ``torch.optim`` computes them (``lr / (1 - beta1 ** t)`` etc.).
    """
    by_slot = {rule.slot: rule for rule in rules.values()}
    # built as Python floats and converted once (a cohort is built every round; writing a tensor entry by entry
    # cost about 100 us a round)
    table = [[0.0] * (len(optimizer.param_groups) * SCALARS) for _ in range(steps)]
    for slot, group in enumerate(optimizer.param_groups):
        rule = by_slot.get(slot)
        lr = float(group["lr"])
        for k in range(steps):
            row = table[k]
            at = slot * SCALARS
            if rule is None or rule.kind == "sgd":
                dampening = float(group.get("dampening", 0.0))
                row[at], row[at + 1] = lr, 1.0 if k == 0 else 1.0 - dampening
            else:
                t = k + 1
                row[at] = lr / (1 - rule.beta1**t)
                row[at + 1] = (1 - rule.beta2**t) ** 0.5
                row[at + 2] = 1 - lr * rule.weight_decay
    return torch.tensor(table, dtype=torch.float64).reshape(steps, len(optimizer.param_groups) * SCALARS)


def _apply_rule(rule: UpdateRule, p: Tensor, grad: Tensor, state: tuple[Tensor, ...], s: Tensor):
    """One parameter's update (see the module docstring); ``s`` is the group's scalars at this step."""
    g = -grad if rule.maximize else grad
    if rule.kind == "sgd":
        lr, damp = s[0], s[1]
        if rule.weight_decay != 0:
            g = g + rule.weight_decay * p
        if rule.momentum != 0:
            # buf starts at zero, so the first step (damp = 1) gives buf = g exactly, as torch.optim's clone does
            buf = state[0] * rule.momentum + damp * g
            g = g + rule.momentum * buf if rule.nesterov else buf
            state = (buf,)
        return p - lr * g, state
    step_size, bias2_sqrt, decay = s[0], s[1], s[2]
    if rule.weight_decay != 0:
        if rule.decoupled:
            p = p * decay
        else:
            g = g + rule.weight_decay * p
    exp_avg = torch.lerp(state[0], g, 1 - rule.beta1)
    exp_avg_sq = state[1] * rule.beta2 + (1 - rule.beta2) * g * g
    denom = exp_avg_sq.sqrt() / bias2_sqrt + rule.eps
    return p - step_size * exp_avg / denom, (exp_avg, exp_avg_sq)


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


def make_fused_step(loss: Callable, rules: dict[str, UpdateRule]) -> Callable:
    """The cohort step as a pure function (compiled by :class:`CompiledSteps`).

    ``step(params, buffers, state, batch, batch_idx, active, scalars, loss_sum)
    -> (params, state, buffers, loss_sum, losses, logged)``. Parameters without a rule (frozen) are passed through;
    the stacked buffers ``[rows, *shape]`` come back updated in the active rows only.
    """

    def step(params, buffers, state, batch, batch_idx, active, scalars, loss_sum):
        compute = vmap(grad_and_value(loss, has_aux=True), in_dims=(0, 0, 0, None), randomness="different")
        grads, (losses, (logged, after)) = compute(params, _copies(buffers), batch, batch_idx)
        new_params, new_state = {}, {}
        for name, p in params.items():
            rule = rules.get(name)
            if rule is None:  # a frozen parameter: it and its (empty) state pass through, keeping the state's keys
                new_params[name], new_state[name] = p, state[name]
                continue
            s = scalars[rule.slot * SCALARS : (rule.slot + 1) * SCALARS]
            updated, moved = _apply_rule(rule, p, grads[name], state[name], s)
            rows = _rows(active, p)
            new_params[name] = torch.where(rows, updated, p)
            new_state[name] = tuple(torch.where(rows, m, old) for m, old in zip(moved, state[name]))
        loss_sum = loss_sum + torch.where(active, losses.detach().to(loss_sum.dtype), 0)
        new_buffers = _mask_buffers(active, after, buffers)
        return new_params, new_state, new_buffers, loss_sum, losses.detach(), logged

    return step


def make_grad_step(loss: Callable) -> Callable:
    """``grads, (losses, logged), buffers = step(params, buffers, batch, batch_idx, active)``: the vmapped gradient
    alone, and the stacked buffers updated in the ``active`` rows."""

    def step(params, buffers, batch, batch_idx, active):
        compute = vmap(grad_and_value(loss, has_aux=True), in_dims=(0, 0, 0, None), randomness="different")
        grads, (losses, (logged, after)) = compute(params, _copies(buffers), batch, batch_idx)
        return grads, (losses, logged), _mask_buffers(active, after, buffers)

    return step


def _own_code(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object.

    Dynamo keeps compiled graphs per code object and stops compiling a code object after
    ``torch._dynamo.config.recompile_limit`` variants (silently running it eagerly). Every module and optimizer
    configuration gets its own copy of the step function, so one model's shapes never use up another's budget. The
    copy is renamed (``step_1``, ``step_2``, ...): code objects compare equal by content, and Dynamo's record of
    recompilation reasons (``guard_failures``) is a dict keyed by code, so each entry's reasons stay its own.
    """
    name = f"{fn.__name__}_{next(_code_numbers)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_code_numbers = itertools.count(1)


#: recompilations for new values of one guarded Python value after which the compiled step is given up
RECOMPILE_GUARD_LIMIT = 3


class CompiledEntry:
    """One module's compiled steps for one optimizer configuration and compile mode.

    ``failed`` holds the cause once compiling failed (or kept recompiling, see :meth:`recompile_cause`), so that
    later rounds do not try (and warn) again.
    """

    def __init__(self, module: nn.Module, rules: dict[str, UpdateRule] | None, mode: str) -> None:
        self.module = module  # kept alive while cached, so its id cannot be reused by another module
        self.step_module = StepModule(module)
        self.collector = LogCollector()
        self.mode = mode
        self.failed: str | None = None
        loss = make_loss(self.step_module, self.collector)
        fn = _own_code(make_fused_step(loss, rules) if rules is not None else make_grad_step(loss))
        self.code = fn.__code__
        self.fn = torch.compile(fn, mode=None if mode == "default" else mode, fullgraph=True)
        self._seen_failures = 0
        self._recompiles: dict[str, int] = {}

    def recompile_cause(self) -> str | None:
        """Why the step keeps recompiling, once one guarded Python value has forced :data:`RECOMPILE_GUARD_LIMIT`
        recompilations (e.g. ``training_step`` assigns ``self.counter``, which the compiler treats as a constant);
        ``None`` otherwise. Call after each call of :attr:`fn`.

        Dynamo records why each cached graph did not fit a call (``torch._dynamo.utils.guard_failures``, keyed by
        this entry's own code object); a recompilation's first reason is the newest graph's failed guard. Shape
        changes (a new cohort-size bucket) are bounded and never counted.
        """
        failures = guard_failures.get(self.code, ())
        if len(failures) == self._seen_failures:
            return None
        newest = str(failures[self._seen_failures])
        self._seen_failures = len(failures)
        guard = newest.split(":", 1)[-1].split("#", 1)[0].strip()
        if "mismatch" in guard:  # size / stride / dtype of a tensor: one graph per bucket, bounded
            return None
        key = re.sub(r"\d+", "#", guard)
        self._recompiles[key] = self._recompiles.get(key, 0) + 1
        if self._recompiles[key] < RECOMPILE_GUARD_LIMIT:
            return None
        return describe_guard(newest, self._recompiles[key])


def describe_guard(reason: str, count: int) -> str:
    """A user-facing cause from a Dynamo guard-failure reason, e.g. ``"training_step changes self.counter (self.counter
    += 1): a Python value the compiler takes as a constant, so each new value recompiled the step (3 times)"``."""
    guard = reason.split(":", 1)[-1].split("#", 1)[0].strip()
    path = re.search(r"\['lm'\]((?:\._modules\['\w+'\]|\.\w+)+)", guard)
    name = "self" + re.sub(r"\._modules\['(\w+)'\]", r".\1", path.group(1)) if path else guard
    name = re.sub(r"\.(_modules|_parameters|_buffers)$", "", name)
    source = re.search(r"#\s*(.+?)\s*#\s*\S+ in (\w+)", reason)
    where = f"{source.group(2)} changes {name} ({source.group(1)})" if source else f"the step depends on {guard}"
    return (
        f"{where}: a Python value that torch.compile takes as a constant, so each new value recompiled the step "
        f"({count} times); keep such state in a tensor (register_buffer) to stay compiled"
    )


_entries: OrderedDict[tuple, CompiledEntry] = OrderedDict()


def compiled_entry(module: nn.Module, rules: dict[str, UpdateRule] | None, mode: str) -> CompiledEntry:
    """The cached :class:`CompiledEntry` (built on first use; the least recently used modules are dropped)."""
    key = (id(module), None if rules is None else tuple(sorted(rules.items())), mode)
    entry = _entries.get(key)
    if entry is None or entry.module is not module:
        entry = CompiledEntry(module, rules, mode)
        _entries[key] = entry
    _entries.move_to_end(key)
    modules = list(dict.fromkeys(k[0] for k in _entries))
    for stale in modules[:-_CACHE_MODULES]:
        for k in [k for k in _entries if k[0] == stale]:
            del _entries[k]
    return entry
