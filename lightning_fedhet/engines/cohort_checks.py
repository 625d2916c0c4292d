"""What a vmap cohort can simulate exactly: the checks that refuse the rest, naming the cause.

:func:`check_vmap_support` reads the module and its optimizer (any run on the vmap engine); :func:`check_persistable`
the optimizer and the rule when each client keeps its own optimizer state (``optimizer_state="persist"``);
:func:`check_vmap_fit` a whole fit, both of them included (the engine's setup and ``engine="auto"`` both ask it, so
they cannot disagree).
Each raises :class:`~lightning_fedhet.engines._compiled.VmapUnsupported`, whose message names the
``engine="sequential"`` fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_fedhet.engines._compiled import VmapUnsupported
from lightning_fedhet.engines.layout import StateLayout, normalisation_layers

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)


def check_vmap_support(
    module: nn.Module, optimizer: torch.optim.Optimizer, layout: StateLayout | None = None
) -> None:
    """Raise :class:`VmapUnsupported` for the cases the engine cannot simulate faithfully (``layout``: the module's,
    whose normalisation layers are then read from it instead of walking the module tree)."""
    norms = layout.norms if layout is not None else normalisation_layers(module)
    for name, sub in norms:
        if sub.track_running_stats and sub.momentum is None:
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


def check_persistable(optimizer: torch.optim.Optimizer, sends_client_config: bool = False) -> None:
    """Raise :class:`VmapUnsupported` where a cohort cannot carry each client's own optimizer state between its
    rounds (``optimizer_state="persist"``) exactly as the sequential engine does. A cohort carries SGD's momentum
    buffers: a client without a kept buffer starts from zeros, and with ``dampening=0`` the first step
    ``0 * momentum + g`` is exactly torch's ``buf = g``."""
    if type(optimizer) is not torch.optim.SGD:
        raise VmapUnsupported(
            f"optimizer_state='persist' with {type(optimizer).__name__}: its state holds a step count per client, "
            "which a cohort's stacked optimizer shares; a cohort carries SGD's momentum buffers only"
        )
    for group in optimizer.param_groups:
        if group["momentum"] != 0 and group["dampening"] != 0:
            # torch's first step takes the whole gradient (buf = g), a kept buffer's (1 - dampening) of it, and one
            # step of the stacked optimizer treats every row alike
            raise VmapUnsupported(
                f"optimizer_state='persist' with SGD dampening={group['dampening']}: a client's first step with "
                "and without a kept momentum buffer differ, and a cohort steps every client alike; use dampening=0"
            )
    if sends_client_config:
        # SGD skips a parameter whose gradient is None (the part a client does not train); the stacked step gives it
        # a zero gradient and would move it by its kept momentum
        raise VmapUnsupported(
            "optimizer_state='persist' with a rule that trains a different part of the model on each client: a "
            "kept momentum buffer would move the parts a client does not train"
        )


def check_vmap_fit(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    optimizer_state: str,
    sends_client_config: bool,
    rule: str,
) -> None:
    """Raise :class:`VmapUnsupported` for a fit the vmap engine cannot simulate: ``optimizers`` are the module's
    (the engine steps exactly one), ``optimizer_state`` and ``sends_client_config`` the server's, ``rule`` the rule's
    name for the message."""
    if len(optimizers) != 1:
        raise VmapUnsupported(f"the module has {len(optimizers)} optimizers; the engine steps exactly one")
    check_vmap_support(module, optimizers[0])
    if optimizer_state == "persist":
        check_persistable(optimizers[0], sends_client_config)
    # every optimizer check_vmap_support lets through has weight_decay in each parameter group
    decay = [group["weight_decay"] for group in optimizers[0].param_groups]
    if sends_client_config and any(decay):
        # a stacked step gives a part the client does not train a zero gradient, which weight decay still moves
        raise VmapUnsupported(
            f"{rule} trains a different part of the model on each client and the optimizer has "
            f"weight_decay={decay}, which would move the parts a client does not train"
        )


def momentum_positions(optimizer: torch.optim.Optimizer, names_by_id: dict[int, str]) -> list[tuple[int, str]]:
    """``(position, name)`` of every trainable parameter that SGD ``optimizer`` keeps a momentum buffer for; the
    position counts the optimizer's parameters over its groups in order, as ``export_optimizer_state`` keys them."""
    out = []
    position = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if group["momentum"] != 0 and p.requires_grad:
                out.append((position, names_by_id[id(p)]))
            position += 1
    return out
