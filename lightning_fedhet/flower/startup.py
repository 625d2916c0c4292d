"""What :class:`~lightning_fedhet.flower.strategy.FedHetFlowerStrategy` checks and waits for before round 0."""

from __future__ import annotations

import logging
import time

import torch
from flwr.serverapp import Grid
from torch import nn

from lightning_fedhet.engines.registry import AUTO
from lightning_fedhet.spec import FederationSpec

log = logging.getLogger("flwr")  # Flower's logger: the messages appear with Flower's own

#: what a Flower run takes as it is (the nodes' links, their timing, their data and their own training), with the
#: only value of each setting a spec for it may hold
SIMULATED_SETTINGS = {
    "channel": None,
    "latency": None,
    "deadline": None,
    "partitioner": None,
    "engine": AUTO,  # the spec's defaults: each node trains through its own Trainer, no engine of ours
    "compile": None,
    "optimizer_state": "reset",
}


def refuse_simulated_settings(spec: FederationSpec) -> None:
    """Refuse a spec that sets what only a simulation has: the Flower run would silently not do it."""
    if spec.num_clients is None:
        raise ValueError("FedHetFlowerStrategy needs the spec's num_clients (the number of client nodes of the run)")
    set_here = []
    for name, only in SIMULATED_SETTINGS.items():
        value = getattr(spec, name)
        if (value is not None) if only is None else (value != only):
            set_here.append(f"{name}={value!r}")
    if set_here:
        raise ValueError(
            f"FedHetFlowerStrategy cannot simulate {', '.join(set_here)}: on Flower the links, the timing, the data "
            "and the clients' training are the nodes' own; leave these settings at their defaults"
        )


def wait_for_nodes(grid: Grid, num_clients: int, timeout: float) -> list[int]:
    """The connected node ids once at least ``num_clients`` are connected (``TimeoutError`` after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while len(node_ids := sorted(grid.get_node_ids())) < num_clients:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"num_clients={num_clients} nodes were expected but {len(node_ids)} connected within {timeout} s"
            )
        log.info("waiting for nodes: %d of %d connected", len(node_ids), num_clients)
        time.sleep(1.0)
    return node_ids


def first_optimizer(module: nn.Module) -> torch.optim.Optimizer | None:
    """The first optimizer of a LightningModule's ``configure_optimizers`` (for the rule's solver check), or
    ``None`` when the module has none or returns a form this does not read."""
    configure = getattr(module, "configure_optimizers", None)  # a LightningModule's; plain modules have none
    if configure is None:
        return None
    try:
        conf = configure()
    except Exception as err:  # e.g. a schedule that reads self.trainer, which the server's module does not have
        log.warning("the rule's client-solver check was skipped: configure_optimizers() failed here (%r)", err)
        return None
    if isinstance(conf, dict):
        conf = conf.get("optimizer")
    if isinstance(conf, (list, tuple)) and conf:
        conf = conf[0]
        if isinstance(conf, (list, tuple)) and conf:  # ([optimizers], [schedulers])
            conf = conf[0]
        if isinstance(conf, dict):
            conf = conf.get("optimizer")
    return conf if isinstance(conf, torch.optim.Optimizer) else None
