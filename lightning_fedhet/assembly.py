"""Assembling a run: from the strategy's arguments and Lightning's train dataloader to a ready Server.

Shared by every Lightning adapter (one process or many), so they differ only in Lightning plumbing.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_fedhet._checks import check_choice, check_int, check_real
from lightning_fedhet.algorithms.base import Algorithm
from lightning_fedhet.data.datamodule import FederatedDataModule, split_dataset
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import RoundPlanner
from lightning_fedhet.flat import FlatModel
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.seeding import resolve_seed
from lightning_fedhet.server import CLIENT_WEIGHTS, OPTIMIZER_STATES, UPDATE_NORM_ACTIONS, Server, check_update_norm
from lightning_fedhet.system.steps import check_local_steps, local_steps_for


def check_arguments(
    *,
    local_steps: Any,
    num_clients: int | None,
    seed: int | None,
    deadline: float | None,
    latency: Any,
    optimizer_state: str,
    client_weights: str,
    participation: Participation | None = None,
    channel: Any = None,
    max_update_norm: float | None = None,
    update_norm_action: str = "reject",
) -> None:
    """Validate the strategy's arguments at construction, before any work (each error names the parameter).

    When ``num_clients`` is known, per-client arguments (local-step lists, per-client probabilities of the
    participation process or the channel) are checked against it here rather than when the fit starts.
    """
    check_choice(optimizer_state, "optimizer_state", OPTIMIZER_STATES)
    check_choice(client_weights, "client_weights", CLIENT_WEIGHTS)
    if num_clients is not None:
        num_clients = check_int(num_clients, "num_clients")
    check_local_steps(local_steps)
    if seed is not None:
        resolve_seed(seed)
    if deadline is not None and latency is None:
        raise ValueError("deadline needs a latency model (latency=ShiftedExponential(...))")
    check_choice(update_norm_action, "update_norm_action", UPDATE_NORM_ACTIONS)
    if isinstance(max_update_norm, numbers.Real) and not isinstance(max_update_norm, bool):
        # an int beyond the float range is refused here, by name (check_update_norm would overflow converting it)
        check_real(max_update_norm, "max_update_norm", 0.0, math.inf, low_open=True, high_open=True)
    check_update_norm(max_update_norm, update_norm_action)
    if num_clients is None:
        return
    local_steps_for(local_steps, 0, num_clients, 0)
    # set up with the client count only to validate lengths; the fit sets them up again with the run's seed
    if participation is not None and not participation.needs_label_hist:
        participation.setup(num_clients, 0)
    if channel is not None:
        channel.setup(num_clients, 0)


def client_streams(dataloader: object, datamodule: object, num_clients: int | None, partitioner: Any, seed: int):
    """Per-client data streams from the train dataloader (its dataset, batch size, collate function, workers)."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"FedHetStrategy needs the train dataloader to be a torch DataLoader, got {type(dataloader).__name__}"
        )
    dataset = dataloader.dataset
    if isinstance(datamodule, FederatedDataModule):
        client_indices = datamodule.client_indices
        if num_clients is not None and num_clients != len(client_indices):
            raise ValueError(
                f"num_clients={num_clients} but the FederatedDataModule holds {len(client_indices)} clients"
            )
    elif partitioner is not None:
        client_indices = split_dataset(dataset, partitioner, num_clients, seed)
    else:
        raise ValueError(
            "FedHetStrategy does not know how to split the training data: use a FederatedDataModule, or pass "
            "FedHetStrategy(num_clients=..., partitioner=IID() | Dirichlet(alpha) | index lists)"
        )
    batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None) or 1
    return ClientStreams(
        dataset,
        client_indices,
        batch_size=batch_size,
        seed=seed,
        collate_fn=dataloader.collate_fn,
        num_workers=dataloader.num_workers,
        pin_memory=dataloader.pin_memory,
    )


def build_server(
    module: nn.Module,
    dataloader: object,
    datamodule: object,
    *,
    algorithm: Algorithm,
    participation: Participation,
    local_steps: Any,
    selection: Any,
    channel: Any,
    latency: Any,
    deadline: float | None,
    num_clients: int | None,
    partitioner: Any,
    seed: int,
    client_weights: str,
    optimizer_state: str,
    max_update_norm: float | None = None,
    update_norm_action: str = "reject",
) -> tuple[Server, FlatModel]:
    """The run's Server (global model = the module's current weights) and the module's flat view."""
    streams = client_streams(dataloader, datamodule, num_clients, partitioner, seed)
    planner = RoundPlanner(
        participation=participation,
        algorithm=algorithm,
        streams=streams,
        local_steps=local_steps,
        selection=selection,
        channel=channel,
        latency=latency,
        deadline=deadline,
        seed=seed,
    )
    flat = FlatModel(module)
    with torch.no_grad():
        init = flat.get()
    server = Server(
        planner,
        algorithm,
        init,
        flat.num_parameters,
        client_weights=client_weights,
        optimizer_state=optimizer_state,
        init_ints=flat.get_ints(),
        max_update_norm=max_update_norm,
        update_norm_action=update_norm_action,
    )
    return server, flat
