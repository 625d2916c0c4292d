"""The vmap cohort engine: a whole round's cohort trains at once with ``torch.func``.

Each client's parameters are one row of stacked tensors ``[C, *shape]``. One local step of the cohort is a
single ``vmap(grad_and_value(training_step))`` call over the stacked parameters and the stacked client
batches ``[C, B, ...]``, followed by one step of the user's optimizer class on the stacked tensors. Because
the supported optimizers (SGD, Adam, AdamW, RMSprop, Adagrad) update every element independently, stepping
the stacked tensors is the same as stepping each client's copy with its own state; their one scalar per
tensor (Adam's step count) is shared, which is exact because every client still training has taken the same
number of steps. Clients with fewer local steps than the round's maximum are masked: after each step their
rows (parameters and optimizer state) are put back, so they stay at their last real step.

Limits (each raises :class:`VmapUnsupported` naming the cause and the ``engine="sequential"`` fallback):
modules with running statistics (BatchNorm), optimizers whose state is not elementwise (LBFGS, ...),
per-client persistent optimizer state, data-dependent Python control flow in ``training_step`` (caught when
``torch.func`` refuses it), manual optimization. ``self.log`` inside ``training_step`` works: each logged
value is computed per client and the strategy logs their mean.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from lightning_fedhet.data.streams import stack_batches  # noqa: F401  (re-exported: its earlier home)
from lightning_fedhet.engines.base import Engine
from lightning_fedhet.federation import RoundPlan

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)


class VmapUnsupported(RuntimeError):
    """The model, optimizer or configuration cannot run under ``engine="vmap"``."""

    def __init__(self, cause: str) -> None:
        super().__init__(f"engine='vmap' cannot run this: {cause}. Use engine='sequential' instead.")


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


class _TrainingStep(nn.Module):
    """Makes ``lightning_module.training_step`` the ``forward`` that ``functional_call`` runs."""

    def __init__(self, lightning_module: nn.Module) -> None:
        super().__init__()
        self.lm = lightning_module

    def forward(self, batch, batch_idx: int):
        return self.lm.training_step(batch, batch_idx)


class _LogCollector:
    """Stands in for ``LightningModule.log`` during a vmapped step: records names and per-client values."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.values: list[Tensor] = []
        self.kwargs: list[dict] = []

    def __call__(self, name: str, value, *args, **kwargs) -> None:
        self.names.append(name)
        self.values.append(torch.as_tensor(value, dtype=torch.float32))
        self.kwargs.append(kwargs)

    def clear(self) -> None:
        self.names, self.values, self.kwargs = [], [], []


class VmapCohort:
    """One round's cohort, trained in lock-step.

    Args:
        module: the user's LightningModule (its parameters hold the global model).
        optimizer: the user's optimizer (class, hyper-parameters and current learning rates are copied).
        clients: the cohort's client ids (length ``C``).
        local_steps: steps each client runs, int ``[C]``.
    """

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, clients: Sequence[int], local_steps: np.ndarray
    ) -> None:
        check_vmap_support(module, optimizer)
        self.module = module
        self.clients = list(clients)
        self.local_steps = torch.as_tensor(np.asarray(local_steps), dtype=torch.int64)
        self.step_module = _TrainingStep(module)
        self.names = [name for name, _ in module.named_parameters()]
        size = len(self.clients)
        self.params = {
            name: p.detach().unsqueeze(0).repeat(size, *([1] * p.dim())).requires_grad_(p.requires_grad)
            for name, p in module.named_parameters()
        }
        self.buffers = {name: b for name, b in module.named_buffers()}
        by_id = {id(p): name for name, p in module.named_parameters()}
        groups = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": [self.params[by_id[id(p)]] for p in group["params"]], **hyper})
        self.optimizer = type(optimizer)(groups)
        self.logs = _LogCollector()

    def _loss(self, params: dict[str, Tensor], batch, batch_idx: int):
        self.logs.clear()
        state = {f"lm.{k}": v for k, v in params.items()}
        state.update({f"lm.{k}": v for k, v in self.buffers.items()})
        out = functional_call(self.step_module, state, (batch, batch_idx))
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise VmapUnsupported("training_step must return the loss tensor (or a dict with 'loss')")
        return loss, tuple(self.logs.values)

    def step(self, batch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Run local step ``step`` for every client whose ``local_steps > step``.

        Args:
            batch: the clients' mini-batches stacked on a leading client dimension ``[C, B, ...]``.
            step: 0-based local step index.

        Returns:
            per-client losses ``[C]`` and the per-client values ``[C]`` of every ``self.log`` call.
        """
        active = self.local_steps > step
        frozen = (~active).nonzero().flatten()
        saved = None
        if frozen.numel():
            saved = self._snapshot(frozen)
        original_log = self.module.log
        self.module.log = self.logs
        try:
            compute = vmap(grad_and_value(self._loss, has_aux=True), in_dims=(0, 0, None), randomness="different")
            params = {k: v.detach() for k, v in self.params.items()}
            grads, (losses, values) = compute(params, batch, step)
        except VmapUnsupported:
            raise
        except RuntimeError as err:
            raise VmapUnsupported(f"torch.func could not transform training_step ({err})") from err
        finally:
            self.module.log = original_log
        for name, p in self.params.items():
            p.grad = grads[name] if p.requires_grad else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if saved is not None:
            self._restore(frozen, saved)
        logged = {name: value for name, value in zip(self.logs.names, values)}
        return losses.detach(), logged

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
        return torch.cat([self.params[n].detach().reshape(size, -1) for n in self.names], dim=1)


class VmapEngine(Engine):
    """The round's cohort in lock-step (see the module docstring).

    Clients are grouped by mini-batch size and by the rule's per-client config (Fed-CIS's exit): one
    :class:`VmapCohort` per group, each stepped with the module configured for its group. A config is supported
    exactly only without weight decay: torch.func gives a dense zero gradient to a parameter the client does not
    train, and weight decay would move it, where the sequential engine (gradient ``None``) leaves it untouched.
    """

    name = "vmap"
    keeps_client_optimizer_state = False

    def __init__(self) -> None:
        super().__init__()
        self.cohorts: list[VmapCohort] = []
        self.configs: list[dict] = []
        self._loss_sums: list[Tensor] = []
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
            self.cohorts.append(VmapCohort(self.module, self.optimizers[0], clients, plan.local_steps[clients]))
            self.configs.append(configs[key])
        self._loss_sums = [torch.zeros(len(c.clients)) for c in self.cohorts]
        self._max_steps = int(plan.local_steps.max()) if plan.trained_ids else 0

    def _round_batches(self, plan: RoundPlan) -> Iterator:
        by_client: dict[int, list[np.ndarray]] = {}
        for (client, _), idx in zip(plan.schedule, plan.batches):
            by_client.setdefault(client, []).append(idx)
        streams = self.server.streams
        # A client that has finished repeats its last batch; the cohort leaves its rows unchanged.
        return (
            [
                streams.stacked_batch(np.stack([by_client[c][min(k, len(by_client[c]) - 1)] for c in cohort.clients]))
                for cohort in self.cohorts
            ]
            for k in range(self._max_steps)
        )

    def on_batch_start(self) -> None:
        return None

    def training_step(self, default_step, batch: Any, batch_idx: int) -> None:
        logs: dict[str, list[Tensor]] = {}
        for i, (cohort, group_batch) in enumerate(zip(self.cohorts, batch)):
            self.apply_config(self.configs[i])
            losses, logged = cohort.step(group_batch, self.step)
            active = cohort.local_steps > self.step
            self._loss_sums[i] += torch.where(active, losses.detach().float().cpu(), 0.0)
            for name, values in logged.items():
                logs.setdefault(name, []).append(values[active])
        for name, chunks in logs.items():
            self.module.log(name, torch.cat(chunks).mean(), on_step=False, on_epoch=True, batch_size=1)
        # The cohort stepped its own stacked copies; Lightning's optimizer has nothing to do.
        return None

    def on_batch_end(self, output: Any) -> None:
        self.step += 1
        if self.step == self._max_steps:
            self._submit_all()
            self.close_round()

    def _submit_all(self) -> None:
        server = self.server
        vector = server.global_vector
        num_parameters = self.flat.num_parameters
        for cohort, loss_sum in zip(self.cohorts, self._loss_sums):
            deltas = cohort.flat_params().to(vector) - vector[:num_parameters]
            mean_losses = (loss_sum / cohort.local_steps.clamp(min=1)).tolist()
            for i, client in enumerate(cohort.clients):
                delta = vector.new_zeros(vector.shape)
                delta[:num_parameters] = deltas[i]
                server.submit(client, delta, mean_losses[i])
        self.cohorts = []
