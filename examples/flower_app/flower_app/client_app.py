"""The ClientApp: each node trains the shared LightningModule on its own partition with a Lightning Trainer."""

from __future__ import annotations

from flwr.app import Context

from flower_app.task import BATCH_SIZE, client_dataset, make_module
from lightning_fedhet.flower import LightningClient


def _module(context: Context):
    return make_module(context.run_config)


def _train_data(context: Context):
    # Flower's simulation sets partition-id / num-partitions on every node; on real devices, pass them with
    # `flower-supernode --node-config "partition-id=3 num-partitions=10"` (or load the device's own data here).
    return client_dataset(
        context.run_config, int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )


app = LightningClient(_module, _train_data, batch_size=BATCH_SIZE).client_app()
